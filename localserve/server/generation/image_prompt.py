"""A chat prompt with images, for a model whose image encoder is loaded (models/vision/adapter.py's
`ImageEncoder`): from the conversation's images to the engine's `MultiModalInputs`.

1. Each image is made ready for the model (`ImageEncoder.prepare` on its first frame as decoded) on a worker
   thread: Pillow and the preprocessing never hold up the event loop. What the model's encoder made of a picture
   is kept by its pixel hash while the model is loaded (`ModelLease.prepared_images`, server/request/
   image_cache.py), so a picture sent again is neither decoded nor prepared again.
2. The chat template renders the conversation with an image part where each image stands (`with_image_parts`)
   and writes the family's marker there; `RequestImages.expand` (engine/image_prompt.py's `ImagePrompt.expand`,
   its error a 400 naming the part), run by the tokenizer on the rendered text,
   puts each image's text in place of its marker (Gemma 3: the begin-of-image token, the image's soft tokens
   and the end-of-image token between blank lines, as transformers' processor does). A template that wrote
   another number of markers than there are images is the client's conversation's fault as far as the client
   can tell (a template that drops images of some roles, say): a 400 naming the image part.
3. In the prompt's ids, image i's span is the first run of its `span_ids` after image i-1's span; its
   `ImageSpan` carries the hash of the image's pixels (`ImageInput.sha256`), so the prefix cache hits only on
   the same pixels, and its embeddings are made by the encoder on the engine thread, once while cached.

A conversation stored for `previous_response_id` keeps its images on its messages (`STORED_IMAGES`, never
shown to a template: `template_view`), so the next turn's prompt holds them again where they were and its
prefix (the earlier image's blocks included) is a cache hit.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from localserve.engine.image_prompt import ImageCountError, ImageEncoder, ImagePrompt, PreparedImage, SpanNotFoundError
from localserve.engine.multimodal import MultiModalInputs
from localserve.server.request.generation_request import STORED_IMAGES, Message
from localserve.server.request.image_cache import BytesLRU
from localserve.server.request.images import ImageInput, PlacedImage
from localserve.server.request.validation import ProtocolError

_SPAN_NAMED = re.compile(r"image span (\d+) ")


def keep_images(messages: Sequence[Message], images: Sequence[PlacedImage]) -> list[Message]:
    """The request's input `messages` with each one's images kept on it (`STORED_IMAGES`: (offset, image)
    pairs), so the stored conversation keeps them; the others as they are."""
    by_message: dict[int, list[tuple[int, ImageInput]]] = {}
    for placed in images:
        by_message.setdefault(placed.message, []).append((placed.offset, placed.image))
    return [{**message, STORED_IMAGES: tuple(by_message[index])} if index in by_message else message
            for index, message in enumerate(messages)]


def keep_first_images(messages: Sequence[Message], count: int) -> list[Message]:
    """`messages` in `with_image_parts`' form with only their first `count` image parts (in order)."""
    kept, seen = [], 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                image = isinstance(part, dict) and part.get("type") == "image"
                seen += image
                if not image or seen <= count:
                    parts.append(part)
            message = {**message, "content": parts}
        kept.append(message)
    return kept


def conversation_images(conversation: Sequence[Message]) -> list[PlacedImage]:
    """The images a conversation's messages keep, in order, each placed in its message (an index into
    `conversation`)."""
    return [PlacedImage(index, offset, image) for index, message in enumerate(conversation)
            for offset, image in sorted(message.get(STORED_IMAGES, ()), key=lambda kept: kept[0])]


@dataclass(frozen=True)
class RequestImages:
    """A request's images made ready (engine/image_prompt.py's `ImagePrompt`), with their parts for errors."""

    prompt: ImagePrompt
    images: tuple[ImageInput, ...]

    def expand(self, rendered: str) -> str:
        """`ImagePrompt.expand`; a ProtocolError (400) naming the image part when the template wrote another
        number of markers than there are images."""
        try:
            return self.prompt.expand(rendered)
        except ImageCountError as error:
            where = self.images[min(error.found, len(self.images) - 1)].where
            raise ProtocolError("invalid_prompt", f"'{where}': {error} in the conversation (does the model's chat "
                                "template take images in this role?)", where) from None

    def name_unplaced(self, error: ProtocolError, messages: Sequence[Message],
                      markers: Callable[[list[Message]], int]) -> ProtocolError:
        """`expand`'s 400 naming the first image the template did not place (a template that drops a system
        turn's image and keeps a later user's: not the image at the count of markers found): the k-th, for the
        first k whose conversation with only its first k images (`keep_first_images`) gets fewer than k
        markers from `markers` (which renders it; a template that raises on it has placed none)."""
        for count in range(1, len(self.images) + 1):
            try:
                placed = markers(keep_first_images(messages, count))
            except Exception:  # noqa: BLE001 - the template's refusal of the cut conversation
                placed = -1
            if placed < count:
                where = self.images[count - 1].where
                return ProtocolError(error.code, f"'{where}'" + error.message[len(f"'{error.param}'"):], where)
        return error

    def refusal(self, error: ValueError) -> ProtocolError | None:
        """The engine's refusal of image span i (engine/multimodal.py names it "image span i ...", e.g. a
        bidirectional span longer than a step's token budget) as a 400 naming its part; None for another."""
        found = _SPAN_NAMED.match(str(error))
        if found is None or int(found[1]) >= len(self.images):
            return None
        where = self.images[int(found[1])].where
        return ProtocolError("invalid_request", f"'{where}': this server cannot take the image as it runs the "
                             f"model: {error}", where)

    def multimodal(self, prompt_ids: Sequence[int]) -> MultiModalInputs:
        """`ImagePrompt.multimodal`; an image whose tokens are not found is the server's failure (500)."""
        try:
            return self.prompt.multimodal(prompt_ids)
        except SpanNotFoundError as error:
            raise ProtocolError("internal_error", f"'{self.images[error.index].where}': {error}",
                                error_type="server_error", status=500) from None


async def prepare_images(encoder: ImageEncoder, images: Sequence[PlacedImage],
                         cache: BytesLRU[bytes, PreparedImage] | None = None) -> RequestImages:
    """`images` (in prompt order) made ready for `encoder` on a worker thread; a picture the model's processing
    refuses is a 400 naming its part. `cache`: this encoder's prepared images by pixel hash (`ModelLease.
    prepared_images`): a picture it holds is not decoded nor prepared again (the same pixels prepare alike)."""
    def prepare_one(image: ImageInput) -> PreparedImage:
        found = cache.get(image.sha256) if cache is not None else None
        if found is not None:
            return found
        try:
            prepared = encoder.prepare(image.picture())
        except (ValueError, OSError) as exc:
            raise ProtocolError("invalid_image", f"'{image.where}' cannot be made ready for the model: "
                                f"{str(exc)[:200]}", image.where) from None
        if cache is not None:
            cache.put(image.sha256, prepared, prepared_bytes(prepared))
        return prepared

    def prepare_all() -> tuple[PreparedImage, ...]:
        return tuple(prepare_one(placed.image) for placed in images)

    prepared = await asyncio.to_thread(prepare_all)
    images_in_order = tuple(placed.image for placed in images)
    return RequestImages(ImagePrompt(encoder, tuple(image.sha256 for image in images_in_order), prepared),
                         images_in_order)


def prepared_bytes(prepared: PreparedImage) -> int:
    """About what `prepared` holds in memory: its tensors' bytes (in `inputs`, however nested in tuples, lists and
    dicts, and its rope positions), its text and span ids."""
    def held(value) -> int:
        if hasattr(value, "element_size") and hasattr(value, "numel"):
            return value.element_size() * value.numel()
        if isinstance(value, (tuple, list)):
            return sum(held(item) for item in value)
        if isinstance(value, dict):
            return sum(held(item) for item in value.values())
        return 64
    return (held(prepared.inputs) + held(prepared.rope_positions) + 4 * len(prepared.text)
            + 8 * len(prepared.span_ids) + 256)


def in_prompt_order(images: Sequence[PlacedImage]) -> list[PlacedImage]:
    """By message, then by offset in it (equal offsets keep their order, as `with_image_parts` places them)."""
    return sorted(images, key=lambda placed: (placed.message, placed.offset))


def shifted(images: Sequence[PlacedImage], first: int) -> list[PlacedImage]:
    """`images` placed `first` messages later (the system prompt before the conversation)."""
    return [replace(placed, message=placed.message + first) for placed in images]
