"""A chat prompt with images, for a model whose image encoder is loaded (models/vision/adapter.py's
`ImageEncoder`): from the conversation's images to the engine's `MultiModalInputs`.

1. Each image is made ready for the model (`ImageEncoder.prepare` on its first frame as decoded) on a worker
   thread: Pillow and the preprocessing never hold up the event loop.
2. The chat template renders the conversation with an image part where each image stands (`with_image_parts`)
   and writes the family's marker there; `ImagePrompt.expand`, run by the tokenizer on the rendered text,
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
from collections.abc import Sequence
from dataclasses import dataclass, replace

from localserve.engine.multimodal import ImageSpan, MultiModalInputs
from localserve.models.vision.adapter import ImageEncoder, PreparedImage
from localserve.server.request.generation_request import STORED_IMAGES, Message
from localserve.server.request.images import ImageInput, PlacedImage
from localserve.server.request.validation import ProtocolError


def keep_images(messages: Sequence[Message], images: Sequence[PlacedImage]) -> list[Message]:
    """The request's input `messages` with each one's images kept on it (`STORED_IMAGES`: (offset, image)
    pairs), so the stored conversation keeps them; the others as they are."""
    by_message: dict[int, list[tuple[int, ImageInput]]] = {}
    for placed in images:
        by_message.setdefault(placed.message, []).append((placed.offset, placed.image))
    return [{**message, STORED_IMAGES: tuple(by_message[index])} if index in by_message else message
            for index, message in enumerate(messages)]


def conversation_images(conversation: Sequence[Message]) -> list[PlacedImage]:
    """The images a conversation's messages keep, in order, each placed in its message (an index into
    `conversation`)."""
    return [PlacedImage(index, offset, image) for index, message in enumerate(conversation)
            for offset, image in sorted(message.get(STORED_IMAGES, ()), key=lambda kept: kept[0])]


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt's images made ready for `encoder`, in prompt order."""

    encoder: ImageEncoder
    images: tuple[ImageInput, ...]
    prepared: tuple[PreparedImage, ...]

    def expand(self, rendered: str) -> str:
        """The rendered chat with the i-th marker replaced by image i's text; a ProtocolError (400) when the
        template wrote another number of markers than there are images."""
        pieces = rendered.split(self.encoder.marker)
        found = len(pieces) - 1
        if found != len(self.images):
            where = self.images[min(found, len(self.images) - 1)].where
            raise ProtocolError("invalid_prompt", f"'{where}': the model's chat template placed {found} image "
                                f"marker{'s' if found != 1 else ''} ({self.encoder.marker!r}) for the "
                                f"{len(self.images)} image{'s' if len(self.images) != 1 else ''} of the "
                                "conversation (does it take images in this role?)", where)
        return pieces[0] + "".join(prepared.text + piece for prepared, piece in zip(self.prepared, pieces[1:]))

    def multimodal(self, prompt_ids: Sequence[int]) -> MultiModalInputs:
        """The engine's inputs: each image's span found in the prompt's ids, embeddings made on first use."""
        spans, start = [], 0
        for index, (image, prepared) in enumerate(zip(self.images, self.prepared)):
            offset = find_run(prompt_ids, prepared.span_ids, start)
            if offset is None:
                raise ProtocolError("internal_error", f"image {index} ('{image.where}'): its "
                                    f"{len(prepared.span_ids)} tokens are not in the tokenized prompt after "
                                    f"token {start} (the tokenizer split the image's text)",
                                    error_type="server_error", status=500)
            spans.append(ImageSpan(offset, len(prepared.span_ids), image.sha256,
                                   bidirectional=prepared.bidirectional))
            start = offset + len(prepared.span_ids)
        encoder, prepared_images = self.encoder, self.prepared
        return MultiModalInputs(tuple(spans), lambda index: encoder.encode(prepared_images[index]))


def find_run(ids: Sequence[int], run: Sequence[int], start: int) -> int | None:
    """The first index >= `start` where `ids` holds `run` contiguously, or None."""
    ids, run = list(ids), list(run)
    if not run:
        return None
    first, length = run[0], len(run)
    position = start
    while True:
        try:
            position = ids.index(first, position)
        except ValueError:
            return None
        if ids[position:position + length] == run:
            return position
        position += 1


async def prepare_images(encoder: ImageEncoder, images: Sequence[PlacedImage]) -> ImagePrompt:
    """`images` (in prompt order) made ready for `encoder` on a worker thread; a picture the model's processing
    refuses is a 400 naming its part."""
    def prepare_all() -> tuple[PreparedImage, ...]:
        prepared = []
        for placed in images:
            try:
                prepared.append(encoder.prepare(placed.image.picture()))
            except (ValueError, OSError) as exc:
                where = placed.image.where
                raise ProtocolError("invalid_image", f"'{where}' cannot be made ready for the model: "
                                    f"{str(exc)[:200]}", where) from None
        return tuple(prepared)

    prepared = await asyncio.to_thread(prepare_all)
    return ImagePrompt(encoder, tuple(placed.image for placed in images), prepared)


def in_prompt_order(images: Sequence[PlacedImage]) -> list[PlacedImage]:
    """By message, then by offset in it (equal offsets keep their order, as `with_image_parts` places them)."""
    return sorted(images, key=lambda placed: (placed.message, placed.offset))


def shifted(images: Sequence[PlacedImage], first: int) -> list[PlacedImage]:
    """`images` placed `first` messages later (the system prompt before the conversation)."""
    return [replace(placed, message=placed.message + first) for placed in images]
