"""FSDP2 all-gathers tensorwise FP8 weights in FP8: real 2-process runs (torchrun, gloo, CPU).

One torchrun launch of ``fp8_gather.py`` beside this file (~15 s on 2 shared cores) trains a
small GPT for 6 steps with the FP8 and the 16-bit all-gather (the 16-bit one twice: its
run-to-run spread), with ``layers="auto"``, rowwise, and a checkpoint resume; each test asserts
on what the ranks measured.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from torchrun_helpers import rank_results, result

WORKER = Path(__file__).with_name("fp8_gather.py")
STEPS = 6
#: the FP8 layers: q/k/v, attention output, MLP in and out of both blocks (the head stays bf16)
BLOCK_WEIGHTS = [
    f"blocks.{i}.{n}.weight" for i in range(2) for n in ("attn.qkv", "attn.proj", "fc", "fc_proj")
]

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return rank_results(WORKER, tmp_path_factory.mktemp("fp8_gather"))


def test_tensorwise_weights_are_all_gathered_as_e4m3_bytes(ranks):
    for fp8, bf16 in zip(result(ranks, "fp8"), result(ranks, "bf16")):
        assert fp8["gathered_in_fp8"] == BLOCK_WEIGHTS and bf16["gathered_in_fp8"] == []
        assert fp8["weight_type"] == "GatheredFP8Weight" and bf16["weight_type"] == "Parameter"
        assert len(fp8["gathered_checks"]) == STEPS
        assert {c["data_dtype"] for c in fp8["gathered_checks"]} == {"torch.float8_e4m3fn"}
        # mixed dtypes in one FSDP unit (FP8 weights, bf16 biases) travel as bytes
        assert "torch.uint8" in fp8["gather_dtypes"] and "torch.uint8" not in bf16["gather_dtypes"]


def test_the_fp8_gather_moves_one_byte_less_per_weight_element_about_half(ranks):
    for fp8, bf16 in zip(result(ranks, "fp8"), result(ranks, "bf16")):
        ours, theirs = fp8["gather_bytes_per_step"], bf16["gather_bytes_per_step"]
        assert len(set(ours)) == len(set(theirs)) == 1  # the same every step
        # each FP8 weight is gathered in forward and again in backward, 1 byte instead of 2
        assert theirs[0] - ours[0] == 2 * fp8["fp8_layer_weight_numel"]
        assert ours[0] <= 0.55 * theirs[0]  # biases, embeddings, norms and head stay as they were


def test_the_gathered_weight_is_the_single_process_cast_of_the_whole_weight(ranks):
    """The bytes and scale each rank receives equal casting the whole 16-bit weight with the
    scale of its own amax (what one process computes), bit for bit, at every step."""
    for fp8 in result(ranks, "fp8"):
        assert all(c["bytes_equal"] and c["scale_equal"] for c in fp8["gathered_checks"])


def test_losses_and_gradients_equal_the_16_bit_gathers_bit_for_bit(ranks):
    for fp8, bf16, again in zip(
        result(ranks, "fp8"), result(ranks, "bf16"), result(ranks, "bf16_again")
    ):
        assert again["loss_bits"] == bf16["loss_bits"]  # run-to-run spread: none
        assert fp8["loss_bits"] == bf16["loss_bits"]
        assert fp8["losses"][-1] < fp8["losses"][0] - 0.5  # it learns
    for grads in result(ranks, "grads"):  # every gradient shard after the first backward
        assert grads["bitwise"] and grads["max_abs"] == 0.0


def test_auto_layers_switch_to_the_fp8_gather_after_their_first_batch(ranks):
    for auto, fp8, bf16 in zip(result(ranks, "auto"), result(ranks, "fp8"), result(ranks, "bf16")):
        steps = auto["gather_bytes_per_step"]
        assert steps[0] == bf16["gather_bytes_per_step"][0]  # decided during that gather's step
        assert steps[1:] == fp8["gather_bytes_per_step"][1:]
        assert auto["gathered_in_fp8"] == BLOCK_WEIGHTS
        assert auto["loss_bits"] == fp8["loss_bits"]


def test_rowwise_gathers_16_bits(ranks):
    for row, bf16 in zip(result(ranks, "rowwise"), result(ranks, "bf16")):
        assert row["gathered_in_fp8"] == [] and row["weight_type"] == "Parameter"
        assert row["gather_bytes_per_step"] == bf16["gather_bytes_per_step"]
        assert row["losses"][-1] < row["losses"][0] - 0.5


def test_a_checkpoint_of_an_fp8_gather_model_resumes_exactly(ranks):
    for res in result(ranks, "resume"):
        assert res["fp8"] == BLOCK_WEIGHTS
        assert res["resumed"] == res["uninterrupted"]


def test_a_torch_whose_fsdp_records_differ_gathers_16_bits_with_one_warning(ranks):
    for res, bf16 in zip(result(ranks, "unknown_layout"), result(ranks, "bf16")):
        assert len(res["warnings"]) == 1 and "all-gathered in 16 bits" in res["warnings"][0]
        assert res["gathered_in_fp8"] == []
        assert res["gather_bytes"] == bf16["gather_bytes_per_step"][0]
