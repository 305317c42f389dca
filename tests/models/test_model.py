"""The model against Hugging Face transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import ARCHITECTURES, greedy_paged, make_runner


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_logits_and_greedy_match_transformers(tiny_model_dir, arch):
    folder, hf_model = tiny_model_dir(arch)
    loaded, runner = make_runner(folder)
    prompt = torch.randint(3, 256, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    # A scattered, out-of-order block table exercises the paging.
    block_table = [9, 2, 14, 5, 0, 11, 7]
    ours = runner.prompt_logits(prompt, block_table)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt])).logits[0].float()
    assert (ours - theirs).abs().max().item() < 1e-4

    with torch.no_grad():
        hf_tokens = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy_paged(runner, prompt, 32, block_table) == hf_tokens
