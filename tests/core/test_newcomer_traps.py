"""The traps a new user walks into, each now loud or harmless: a model already cast to 16 bits,
stepping the optimizer passed to initialize, ``fp8=True`` that chose no layer, and Apex's O1
region leaking its float16 into another model's backward."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import mixprec
from mixprec._core import attention, engine
from mixprec._core.hardware import MixprecPerformanceWarning
from mixprec.bench.models import GPT, GPTConfig
from mixprec.compat.apex import amp
from mixprec.fp8.plan import fp8_plan
from mixprec.warnings import MixprecWarning

pytestmark = pytest.mark.filterwarnings("ignore::mixprec._core.hardware.MixprecPerformanceWarning")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def net(seed: int = 0) -> nn.Module:
    """Linears, a BatchNorm (running statistics: buffers) and a LayerNorm."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 4)
    )


def data(n: int = 8) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def mse(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return (model(x).float() - y).pow(2).mean()


def float_state(model: nn.Module) -> dict[str, torch.dtype]:
    return {k: v.dtype for k, v in model.state_dict().items() if v.is_floating_point()}


def initialize_recording(*args, **kwargs):
    """``mixprec.initialize`` and the UserWarnings it raised about the model's dtypes."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = mixprec.initialize(*args, **kwargs)
    said = [w for w in caught if "initialize received a model" in str(w.message)]
    assert all(w.category is MixprecWarning and w.filename == __file__ for w in said)
    return out, [str(w.message) for w in said]


# -- a model already cast to 16 bits --------------------------------------------------------


@pytest.mark.parametrize("cast", [BF16, FP16])
def test_o1_upcasts_a_16_bit_model_to_fp32_and_says_the_weights_are_rounded(cast):
    model = net()
    rounded = {k: v.to(cast).float() for k, v in model.state_dict().items()}
    model.to(cast)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (model, opt), said = initialize_recording(model, opt, "O1", BF16)
    assert set(float_state(model).values()) == {FP32}  # parameters and running statistics
    assert all(torch.equal(v.float(), rounded[k]) for k, v in model.state_dict().items())
    assert len(said) == 1
    assert f"already cast to {cast}" in said[0] and "level O1 keeps every parameter" in said[0]
    assert "rounded 16-bit values" in said[0] and "Build or load the model in float32" in said[0]
    opt.backward(mse(model, *data()))
    opt.step()
    assert all(p.dtype == FP32 and p.grad.dtype == FP32 for p in model.parameters())


@pytest.mark.parametrize("cast", [BF16, FP16])
def test_o2_keeps_norms_fp32_and_one_16_bit_dtype_whatever_the_model_arrived_in(cast):
    """A .half() model at O2 with dtype=bfloat16 was a float16/bfloat16 mix with float16 norms."""
    model = net()
    model.to(cast)
    given = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    (model, opt), said = initialize_recording(model, opt, "O2", BF16)
    dtypes = float_state(model)
    norms = ("1.", "3.")
    assert {d for k, d in dtypes.items() if k.startswith(norms)} == {FP32}  # BN buffers too
    assert {d for k, d in dtypes.items() if not k.startswith(norms)} == {BF16}
    # the masters hold the values the model arrived with, as exactly as fp32 holds them
    masters = dict(zip([n for n, _ in model.named_parameters()], opt.master_params()))
    assert all(torch.equal(masters[n], given[n].float()) for n in given)
    assert len(said) == 1 and f"already cast to {cast}" in said[0]
    assert "level O2 keeps norm layers and master weights in float32" in said[0]
    x, y = data()
    losses = []
    for _ in range(3):
        loss = mse(model, x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert float_state(model) == dtypes


def test_o3_converts_a_model_in_the_other_16_bit_dtype_and_says_so():
    model = net().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (model, opt), said = initialize_recording(model, opt, "O3", BF16)
    assert set(float_state(model).values()) == {BF16}
    assert len(said) == 1 and "in torch.float16" in said[0] and "converted" in said[0]
    assert "Pass dtype=torch.float16" in said[0]


def test_o3_takes_a_model_in_its_own_dtype_without_a_word():
    model = net().to(BF16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (model, _), said = initialize_recording(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "O3", BF16
    )
    assert said == []
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_an_fp32_model_gets_no_warning(level):
    model = net()
    (model, _), said = initialize_recording(
        model, torch.optim.SGD(model.parameters(), lr=0.1), level, BF16
    )
    assert said == []


def test_apex_allow_incoming_model_not_fp32_keeps_o1_weights_as_given():
    model = nn.Linear(8, 8).half()
    try:
        amp._amp_state.allow_incoming_model_not_fp32 = True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = amp.initialize(model, opt_level="O1", verbosity=0)
    finally:
        amp.reset()
    assert model.weight.dtype == FP16
    assert not [w for w in caught if "initialize received a model" in str(w.message)]
    assert not model.__dict__.get("_mixprec_accept_16bit")  # used up by initialize


# -- stepping the optimizer passed to initialize ----------------------------------------------


@pytest.mark.parametrize(
    ("level", "dtype"), [("O1", BF16), ("O2", BF16), ("O2", FP16), ("O3", BF16)]
)
def test_stepping_the_original_optimizer_after_opt_backward_raises_and_changes_nothing(
    level, dtype
):
    x, y = data()

    def start():
        model = net()
        original = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = mixprec.initialize(model, original, level, dtype)
        return model, original, opt

    model, original, opt = start()
    opt.backward(mse(model, x, y))
    weights = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in opt.master_params()]
    with pytest.raises(RuntimeError, match=r"holds the gradients of the returned optimizer's"):
        original.step()
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))
    assert all(torch.equal(a, m) for a, m in zip(masters, opt.master_params()))
    assert not original.state  # no step taken, no state made
    opt.step()  # the returned optimizer steps as if the refused call had never happened
    ref_model, _, ref_opt = start()
    ref_opt.backward(mse(ref_model, x, y))
    ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    assert any(not torch.equal(a, p) for a, p in zip(weights, model.parameters()))


def test_the_error_names_what_a_direct_step_would_lose():
    model = net()
    original = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.initialize(model, original, "O2", BF16)
    opt.backward(mse(model, *data()))
    with pytest.raises(RuntimeError) as err:
        original.step()
    text = str(err.value)
    assert "level O2" in text and "not the model's 16-bit weights" in text
    assert "inf/NaN check" in text and "model, opt = mixprec.initialize(model, opt" in text


def test_a_direct_step_with_fresh_zero_gradients_still_passes():
    """torch.distributed.checkpoint creates optimizer state that way (zero grads, lr 0)."""
    model = net()
    original = torch.optim.AdamW(model.parameters(), lr=0.0)
    model, _wrapped = mixprec.initialize(model, original, "O2", BF16)
    for g in original.param_groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    original.step()
    assert len(original.state) == len(list(model.parameters()))


# -- fp8=True that chose no layer -------------------------------------------------------------


def gpt(n_embd: int = 32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=n_embd))


def fp8_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "fp8= (recipe" in str(w.message)]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore:FP8 on CPU is emulated")
def test_fp8_that_chose_no_linear_says_so_once_at_the_first_step():
    model = gpt()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = mixprec.initialize(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            mixprec.Recipe("O2", BF16, fp8=True),
        )
        assert fp8_warnings(caught) == []  # undecided: the plan says "pending"
        assert all(c.pending for n, c in fp8_plan(model).items() if n != "head")
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            logits = model(ids)
            opt.backward(F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()))
            opt.step()
            opt.zero_grad()
    said = fp8_warnings(caught)
    assert len(said) == 1, said
    warning = next(w for w in caught if "fp8= (recipe" in str(w.message))
    assert issubclass(warning.category, MixprecPerformanceWarning)
    assert warning.filename == __file__  # at the model's call, not inside mixprec
    assert "layers='auto') chose 0 of 9 Linears" in said[0]
    assert "blocks.0.attn.qkv: predicted" in said[0] and "FP8Config(layers='all')" in said[0]
    assert fp8_plan(model).chosen == []


@pytest.mark.filterwarnings("ignore:FP8 on CPU is emulated")
def test_fp8_on_linears_no_fp8_gemm_takes_says_so_at_initialize():
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mixprec.initialize(
            model, None, mixprec.Recipe("O2", BF16, fp8=mixprec.FP8Config(layers="all"))
        )
    said = fp8_warnings(caught)
    assert len(said) == 1 and "layers='all') chose 0 of 2 Linears" in said[0]
    assert "multiples of 16" in said[0]


@pytest.mark.filterwarnings("ignore:FP8 on CPU is emulated")
def test_fp8_that_chose_a_linear_stays_quiet():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = mixprec.initialize(
            model, None, mixprec.Recipe("O2", BF16, fp8=mixprec.FP8Config(layers="all"))
        )
        with torch.no_grad():
            model(torch.randn(4, 32))
    assert fp8_warnings(caught) == []
    assert fp8_plan(model).chosen == ["0"]


# -- Apex's O1 region and another model's backward ------------------------------------------


class Attention(nn.Module):
    """A LayerNorm, one self-attention through F.scaled_dot_product_attention, a head."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.head = nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        return self.head(y.mean(1))


def run_apex_o1_fp16() -> None:
    """Another user's Apex O1 script: its float16 region stays open on this thread."""
    torch.manual_seed(5)
    other = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    other, opt = amp.initialize(other, opt, opt_level="O1", verbosity=0)
    with amp.scale_loss(other(torch.randn(3, 4)).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert engine.is_active()  # the leaked state this test is about


def after_apex_o1(run: Callable[[], Any]) -> Any:
    """``run()`` once another user's Apex O1 script has run in this process (reset after)."""
    try:
        run_apex_o1_fp16()
        return run()
    finally:
        amp.reset()


def train_attention(level: str, steps: int = 3) -> tuple[list[float], list[Tensor]]:
    torch.manual_seed(0)
    model = Attention()
    model, opt = mixprec.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, BF16
    )
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 6, 16, generator=g), torch.tensor([0, 1, 2, 1])
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.fixture
def decompositions(monkeypatch, decompose_small_attention):
    """Counts the calls of mixprec's decomposed attention (the kernel whose backward failed),
    which the tiny model here runs only with the size threshold lifted."""
    calls = []
    real = attention.decomposed_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "decomposed_attention", counted)
    return calls


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_model_trained_after_apex_o1_trains_bit_for_bit_as_alone(level, decompositions):
    """It failed in backward: `expected scalar type Half but found Float`."""
    alone = train_attention(level)
    assert decompositions, "the decomposed attention kernel did not run: nothing is tested"
    after = after_apex_o1(lambda: train_attention(level))
    assert after[0] == alone[0]
    assert all(torch.equal(a, b) for a, b in zip(after[1], alone[1]))


def test_a_plain_backward_inside_a_float16_region_runs_mixprec_attention_backward(
    decompositions,
):
    torch.manual_seed(0)
    model = mixprec.initialize(Attention(), None, "O1", BF16)
    x = torch.randn(2, 6, 16)
    loss = model(x).float().pow(2).mean()
    with mixprec.autocast(FP16):  # e.g. a region left open by another library
        loss.backward()
    assert decompositions
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == FP32 and torch.isfinite(g).all() for g in grads)


def test_checkpointed_blocks_recompute_in_their_own_region_after_apex_o1():
    """The backward runs outside Apex's region; a recomputed forward still finds the frame of
    the region it first ran in."""

    class Checkpointed(Attention):
        def forward(self, x: Tensor) -> Tensor:
            return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)

    def run() -> list[Tensor]:
        torch.manual_seed(0)
        model = Checkpointed()
        model, opt = mixprec.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), "O1", BF16
        )
        x, y = torch.randn(4, 6, 16), torch.tensor([0, 1, 2, 1])
        for _ in range(2):
            opt.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    alone = run()
    after = after_apex_o1(run)
    assert all(torch.equal(a, b) for a, b in zip(after, alone))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_hugging_face_vit_trains_after_apex_o1_as_alone(level):
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
        num_labels=3,
        attn_implementation="sdpa",
    )

    def run() -> list[float]:
        torch.manual_seed(0)
        vit = transformers.ViTForImageClassification(config)
        vit, opt = mixprec.initialize(
            vit, torch.optim.AdamW(vit.parameters(), lr=1e-3), level, BF16
        )
        pixels, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
        losses = []
        for _ in range(2):
            loss = vit(pixel_values=pixels, labels=labels).loss
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    alone = run()
    after = after_apex_o1(run)
    assert after == alone


_FSDP_16BIT = """
import os, tempfile, warnings
import torch, torch.distributed as dist
import mixprec.distributed as mpd
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).to(torch.bfloat16)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    model, opt = mpd.initialize_fsdp(
        model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), "O2", torch.bfloat16
    )
said = [str(w.message) for w in seen if "already cast to torch.bfloat16" in str(w.message)]
print(len(said), sorted({str(p.dtype) for p in model.parameters()}))
opt.backward(model(torch.randn(4, 8)).float().pow(2).mean())
opt.step()
dist.destroy_process_group()
"""


def test_fsdp_with_a_model_already_in_16_bits_shards_fp32_and_says_so():
    """FSDP's fp32 shards are the master weights: a bf16 model gets them back before it is
    sharded, and one warning says they start from rounded values."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _FSDP_16BIT], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[0] == "1 ['torch.float32']"
