"""fp8= on initialize and autocast: which Linears run their GEMMs in FP8, chosen and explained
(fp8_plan), the errors, the warnings, and a model that stays an ordinary model."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec
from mixprec import FP8Config
from mixprec._core import hardware
from mixprec.bench.models import GPT, GPTConfig
from mixprec.fp8 import fp8_plan
from mixprec.fp8 import layers as fp8_layers
from mixprec.fp8.layers import FP8Forward, layers_of

BLOCK = ("attn.qkv", "attn.proj", "fc", "fc_proj")
pytestmark = [
    pytest.mark.filterwarnings("ignore:FP8 on CPU is emulated"),
    pytest.mark.usefixtures("one_thread"),
]


def gpt(n_embd: int = 32, n_layer: int = 2, seed: int = 0, vocab: int = 64) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab, block_size=16, n_layer=n_layer, n_head=2, n_embd=n_embd))


def block_linears(n_layer: int = 2) -> list[str]:
    return [f"blocks.{i}.{name}" for i in range(n_layer) for name in BLOCK]


class GemmsByModule(TorchDispatchMode):
    """Which module ran each GEMM in forward (a module stack kept by hooks), and the backward
    GEMMs by name."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.forward: list[tuple[str, str]] = []
        self.backward: list[str] = []
        self.handles = []
        for name, m in model.named_modules():
            self.handles.append(m.register_forward_pre_hook(self._enter(name)))
            self.handles.append(m.register_forward_hook(self._leave))

    def _enter(self, name: str):
        def hook(module, args) -> None:
            self.stack.append(name)

        return hook

    def _leave(self, module, args, output) -> None:
        self.stack.pop()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("_scaled_mm", "mm", "addmm", "bmm"):
            if torch._C._current_graph_task_id() == -1:
                self.forward.append((self.stack[-1], name))
            else:
                self.backward.append(name)
        return func(*args, **(kwargs or {}))


def step(model, opt, idx):
    logits = model(idx)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx.reshape(-1))
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss


def tokens(batch: int = 4, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_layers_all_runs_every_block_linear_in_fp8_and_not_the_head(recipe):
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = mixprec.initialize(
        model, opt, mixprec.Recipe("O2", torch.bfloat16, fp8=FP8Config(recipe, layers="all"))
    )
    chosen = block_linears()
    plan = fp8_plan(model)
    assert plan.chosen == chosen
    assert not plan["head"].fp8 and "output head" in plan["head"].reason
    with GemmsByModule(model) as g:
        loss = step(model, opt, tokens())
    scaled = [m for m, op in g.forward if op == "_scaled_mm"]
    assert scaled == chosen  # one forward GEMM per chosen Linear, in order
    others = [m for m, op in g.forward if op != "_scaled_mm"]
    assert "head" in others and not set(others) & set(chosen)  # attention bmm + head
    # backward: input and weight gradient of each chosen Linear; the head's two in 16-bit
    assert g.backward.count("_scaled_mm") == 2 * len(chosen)
    assert g.backward.count("mm") == 2
    assert torch.isfinite(loss) and not opt.step_skipped
    # the model stays an nn.Linear model with its parameters and keys
    qkv = model.blocks[0].attn.qkv
    assert type(qkv) is nn.Linear and isinstance(qkv.__dict__["forward"], FP8Forward)
    assert qkv.weight.dtype == torch.bfloat16 and "forward" not in model.head.__dict__


def test_a_predicate_and_a_plan_choose_the_layers():
    model = gpt()
    model = mixprec.initialize(
        model, None, mixprec.Recipe("O2", fp8=FP8Config(layers=lambda n, m: "fc" in n))
    )
    plan = fp8_plan(model)
    assert plan.chosen == [n for n in block_linears() if n.endswith(("fc", "fc_proj"))]
    assert plan["blocks.0.attn.qkv"].reason == "not selected by the layers= predicate"
    # a plan given as layers= is applied as it is, reasons included
    again = mixprec.initialize(gpt(), None, mixprec.Recipe("O2", fp8=FP8Config(layers=plan)))
    assert fp8_plan(again).chosen == plan.chosen
    with GemmsByModule(again) as g, torch.no_grad():
        again(tokens())
    assert [m for m, op in g.forward if op == "_scaled_mm"] == plan.chosen


def test_auto_decides_at_the_first_batch_and_explains_why_a_small_model_stays_16_bit():
    model = mixprec.initialize(gpt(), None, mixprec.Recipe("O2", fp8=True))
    plan = fp8_plan(model)
    assert all(plan[n].pending for n in block_linears()) and plan.chosen == []
    with torch.no_grad():
        model(tokens())
    plan = fp8_plan(model)
    assert plan.chosen == []
    qkv = plan["blocks.0.attn.qkv"]
    assert not qkv.pending and qkv.shape == (64, 32, 96) and qkv.speedup < 1.05
    assert "predicted" in qkv.reason and "H100" in qkv.reason and "below 1.05x" in qkv.reason
    assert qkv.input is not None and qkv.input.sqnr > 25  # the numbers were measured too


def test_fp8_plan_picks_the_block_linears_at_d4096_and_none_at_d256():
    big = gpt(n_embd=4096, n_layer=1)
    plan = fp8_plan(big, tokens(1, 16), tokens=8192)
    assert plan.chosen == block_linears(1), str(plan)
    for name in plan.chosen:
        c = plan[name]
        assert c.speedup >= 1.2 and c.input.sqnr > 25 and c.weight.sqnr > 25
        assert c.reason.startswith("predicted") and "casts survive" in c.reason
    assert "output head" in plan["head"].reason
    del big
    small = fp8_plan(gpt(n_embd=256, n_layer=1), tokens(1, 16), tokens=8192)
    assert small.chosen == []
    assert all("below 1.05x" in small[n].reason for n in block_linears(1)), str(small)
    # the same shapes are judged for the GPU asked for: an L40S's FP8 gain is smaller
    l40s = fp8_plan(gpt(n_embd=256, n_layer=1), tokens(1, 16), config=FP8Config(
        target="l40s"), tokens=8192)  # fmt: skip
    assert l40s.target == "l40s" and "L40S" in l40s["blocks.0.fc"].reason


def test_numbers_that_do_not_survive_the_cast_keep_a_layer_16_bit():
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 2048), nn.Linear(2048, 16))
    x = torch.randn(8, 2048)
    x[:, 0] = 1e6  # one huge feature: per-tensor scaling flushes the other values to zero
    plan = fp8_plan(wide, x, tokens=1 << 16)
    first, second = plan["0"], plan["1"]
    assert first.speedup >= 1.05 and second.speedup >= 1.05  # the speed side says yes
    assert not first.fp8 and first.input.underflow > 0.01, str(plan)
    assert "flushes" in first.reason and "amax 1e+06" in first.reason
    assert second.fp8 and second.input.underflow < 0.01
    # rowwise: one power-of-2 scale per token keeps the same values (each row has the outlier)
    assert fp8_plan(wide, x, tokens=1 << 16, config="rowwise")["0"].input.underflow > 0
    small = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 16))
    with_grads = fp8_plan(small, torch.randn(32, 64), loss_fn=lambda y: y.sum())
    assert with_grads["0"].grad is not None and with_grads["0"].grad.dtype == "float8_e5m2"
    assert all(p.grad is None for p in small.parameters())  # the plan leaves no gradients


def test_candidates_leave_out_the_head_tied_and_own_policy_linears_and_bad_shapes():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, 32)
            self.lin = nn.Linear(32, 32)
            self.odd = nn.Linear(32, 24)  # 24 is not a multiple of 16
            self.kept = nn.Linear(32, 32)
            self.out = nn.Linear(32, 64, bias=False)
            self.out.weight = self.emb.weight  # tied to the embedding
            self.last = nn.Linear(64, 64)

        def forward(self, idx):
            h = self.lin(self.emb(idx))
            return self.last(self.out(self.kept(h) + self.odd(h).sum(-1, keepdim=True)))

    model = Tied()
    mixprec.set_policy(model.kept, "float32")
    model = mixprec.initialize(model, None, mixprec.Recipe("O2", fp8=FP8Config(layers="all")))
    plan = fp8_plan(model)
    assert plan.chosen == ["lin"]
    assert "multiple of 16" in plan["odd"].reason
    assert "embedding" in plan["out"].reason
    assert "own policy" in plan["kept"].reason
    assert "output head" in plan["last"].reason
    with torch.no_grad():
        y = model(torch.randint(0, 64, (2, 16)))
    assert y.dtype == torch.float32 and torch.isfinite(y).all()


def test_a_linear_subclass_with_its_own_forward_is_not_touched():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(Scaled(32, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    model = mixprec.initialize(model, None, mixprec.Recipe("O2", fp8=FP8Config(layers="all")))
    assert fp8_plan(model).chosen == ["1"] and "0" not in fp8_plan(model)


def test_the_model_keeps_its_keys_pickles_copies_and_fp32_state_dict_loads_strict():
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    keys = list(model.state_dict())
    model, opt = mixprec.initialize(model, opt, mixprec.Recipe("O2", fp8=FP8Config(layers="all")))
    step(model, opt, tokens())
    assert list(model.state_dict()) == keys
    plain = gpt(seed=5)
    plain.load_state_dict(mixprec.fp32_state_dict(model, opt), strict=True)
    assert all(p.dtype == torch.float32 for p in plain.parameters())
    twin = copy.deepcopy(model)
    assert twin.blocks[0].fc.__dict__["forward"].module is twin.blocks[0].fc
    loaded = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        x = tokens()
        assert torch.equal(loaded(x), model(x)) and torch.equal(twin(x), model(x))
    assert fp8_plan(loaded).chosen == block_linears()


def test_autocast_fp8_runs_the_chosen_linears_in_the_region_only():
    model = gpt()
    x = tokens()
    with torch.no_grad():
        with mixprec.autocast(torch.bfloat16):
            plain = model(x)
        with (
            GemmsByModule(model) as g,
            mixprec.autocast(mixprec.Recipe("O1", torch.bfloat16, fp8="tensorwise")),
        ):
            auto = model(x)  # "auto": too small for an H100, stays 16-bit
        assert not [m for m, op in g.forward if op == "_scaled_mm"]
        assert torch.equal(auto, plain)
        cfg = FP8Config(layers="all")
        with (
            GemmsByModule(model) as g,
            mixprec.autocast(mixprec.Recipe("O1", torch.bfloat16, fp8=cfg)),
        ):
            fp8 = model(x)
        assert [m for m, op in g.forward if op == "_scaled_mm"] == block_linears()
        assert fp8.dtype == torch.bfloat16 and not torch.equal(fp8, plain)
        assert fp8_plan(model).chosen == block_linears()
        # outside the region the model is what it was, bit for bit
        with mixprec.autocast(torch.bfloat16):
            assert torch.equal(model(x), plain)
        assert torch.equal(model(x), gpt()(x))
    assert not torch.nn.modules.module._global_forward_pre_hooks


def test_bad_fp8_arguments_say_what_is_allowed():
    with pytest.raises(ValueError, match="unknown recipe.*rowwise"):
        FP8Config(recipe="delayed")
    with pytest.raises(ValueError, match="'auto', 'all' or a predicate"):
        FP8Config(layers="most")
    with pytest.raises(TypeError, match="callable"):
        FP8Config(layers=3)
    with pytest.raises(ValueError, match="target"):
        FP8Config(target="a100")
    with pytest.raises(ValueError, match="fp8='e4m3'.*recipe name"):
        mixprec.initialize(gpt(), None, mixprec.Recipe("O2", fp8="e4m3"))
    with pytest.raises(TypeError, match="fp8= takes True"):
        mixprec.initialize(gpt(), None, mixprec.Recipe("O2", fp8=1))
    with pytest.raises(ValueError, match=r"Recipe\(fp8=.*applies inside 16-bit compute"):
        mixprec.Recipe("O0", fp8=True)
    with pytest.raises(ValueError, match="tokens"):
        fp8_plan(gpt(), tokens(), tokens=0)
    with pytest.raises(ValueError, match="without a batch"):
        fp8_plan(gpt())


def test_fp8_support_per_device_and_the_refusal_names_the_gpu(monkeypatch):
    a100 = hardware._fp8_support_for("cuda", (8, 0), "NVIDIA A100-SXM4-80GB", torch.bfloat16)
    assert not a100.supported
    assert "NVIDIA A100-SXM4-80GB" in a100.reason and "8.0" in a100.reason
    assert "torch.bfloat16" in a100.reason and "drop fp8=" in a100.reason
    h100 = hardware._fp8_support_for("cuda", (9, 0), "NVIDIA H100 80GB HBM3", torch.bfloat16)
    assert h100.supported and h100.fast
    assert hardware._fp8_support_for("cuda", (8, 9), "NVIDIA L4", torch.bfloat16).fast
    cpu = hardware.fp8_support("cpu")
    assert cpu.supported and not cpu.fast and "emulated" in cpu.reason
    assert not hardware._fp8_support_for("mps", None, "mps", torch.float32).supported
    monkeypatch.setattr(fp8_layers, "fp8_support", lambda device: a100)
    with pytest.raises(RuntimeError, match="A100.*no FP8 tensor cores"):
        mixprec.initialize(gpt(), None, mixprec.Recipe("O2", fp8=True))


def test_cpu_fp8_warns_once_that_it_is_emulated(monkeypatch):
    monkeypatch.setattr(fp8_layers, "_warned", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mixprec.initialize(gpt(), None, mixprec.Recipe("O2", fp8=True))
        mixprec.initialize(gpt(), None, mixprec.Recipe("O2", fp8=True))
    emulated = [w for w in seen if "emulated" in str(w.message)]
    assert len(emulated) == 1 and issubclass(emulated[0].category, UserWarning)
    assert emulated[0].filename == __file__  # points at the initialize call


def test_mixprec_check_reports_fp8():
    out = subprocess.run(
        [sys.executable, "-m", "mixprec", "check", "--device", "cpu"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(line for line in out.splitlines() if line.startswith("float8"))
    assert "emulated" in line and line.split()[1:3] == ["yes", "no"]
    assert layers_of(gpt()) == {}


def test_auto_under_compile_judges_undecided_layers_by_shape_without_graph_breaks():
    from torch._dynamo.utils import counters

    from mixprec._core import _frames

    model = mixprec.initialize(gpt(), None, mixprec.Recipe("O2", fp8=True))
    compiled = torch.compile(model, backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        out = compiled(tokens())
    assert dict(counters["graph_break"]) == {} and not _frames._state.frames
    assert all(c.pending for n, c in fp8_plan(model).items() if n != "head")
    with torch.no_grad():
        # too small for an H100 by shape alone: the compiled graph ran the 16-bit Linears
        assert torch.equal(out, model(tokens()))  # and an eager call decides

    assert not any(c.pending for c in fp8_plan(model).values())


def test_importing_mixprec_does_not_import_dynamo():
    code = "import sys, mixprec; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
