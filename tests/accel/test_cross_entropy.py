"""The fused cross-entropy kernel: torch's losses and gradients (float64 reference), taken by the objectives from a
model accelerated for training, and only where it measures faster."""
import pytest
import torch
import torch.nn.functional as F

from seqlab.accel import accelerate, restore_plain
from seqlab.accel import cross_entropy as accel_ce
from seqlab.accel.cross_entropy import FusedCrossEntropy
from seqlab.config import ModelConfig
from seqlab.model import build_model
from seqlab.objectives import CausalLM
from seqlab.objectives.loss import IGNORE_INDEX, cross_entropy_kernel, token_cross_entropy
from tests.objectives.helpers import TOK, tiny_model

ISAS = accel_ce.available_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="no C compiler / AVX2 here")
TOLERANCE = {torch.float32: (2e-5, 1e-6), torch.bfloat16: (2e-5, 4e-3)}  # (loss rtol, gradient atol)


def _reference(logits: torch.Tensor, labels: torch.Tensor, scale: float):
    x = logits.double().requires_grad_()
    loss = F.cross_entropy(x, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    (loss * scale).backward()
    return loss.detach(), x.grad


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """The suite runs on one thread per worker: the kernel's rows are also split between two here."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 1003, 4096])
def test_loss_and_gradient_are_torchs(isa, dtype, vocab, threads):
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(37, vocab, generator=g) * 4).to(dtype)
    labels = torch.randint(0, vocab, (37,), generator=g)
    labels[[0, 5, 36]] = IGNORE_INDEX
    logits[3, : vocab // 2] = float("-inf")  # masked-out entries: probability 0
    labels[3] = vocab - 1
    logits[4, labels[4]] = -60.0  # a target whose probability underflows in fp32 softmax terms
    x = logits.clone().requires_grad_()
    loss, n = token_cross_entropy(x, labels, FusedCrossEntropy({dtype: isa}))
    loss.backward(torch.tensor(0.25))
    ref_loss, ref_grad = _reference(logits, labels, 0.25)
    rtol, atol = TOLERANCE[dtype]
    assert n == 34 and loss.dtype == torch.float32 and x.grad.dtype == dtype
    torch.testing.assert_close(loss.double(), ref_loss, rtol=rtol, atol=0)
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=0, atol=atol)
    assert not x.grad[[0, 5, 36]].any()  # ignored rows: no gradient
    assert not x.grad[3, : vocab // 2].any()  # masked-out logits: exactly 0, as torch's


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backwards_scaling_is_torchs_mul_bit_for_bit(isa, dtype, threads):
    """The saved gradient times the loss's gradient: the same bits as ``mul_`` for every non-NaN value (bf16
    widened, multiplied in fp32, rounded to nearest even; subnormals kept), over a length no chunk or vector width
    divides, and NaN where ``mul_`` gives NaN (torch's own NaN bits depend on its loop); what it does not take it
    leaves, and a factor that requires grad under grad mode is left to autograd."""
    kernel = FusedCrossEntropy({dtype: isa})
    grad = (torch.randn(3, 70_001) * 3).to(dtype)
    grad[0, :5] = torch.tensor([0.0, -0.0, float("inf"), 1e-30, 1e-39])
    bf16 = dtype == torch.bfloat16
    grad.view(torch.int16 if bf16 else torch.int32)[0, 5] = 0x7FC0 if bf16 else 0x7FC00000  # a bad row's NaN
    factor = torch.tensor(1 / 2731)

    def bits(t: torch.Tensor) -> torch.Tensor:  # compared as bits: -0.0 != 0.0
        return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)

    expected = grad.clone().mul_(factor)
    assert kernel.scale_(grad, factor)
    nan = expected.isnan()
    assert nan[0, 5] and torch.equal(grad.isnan(), nan) and torch.equal(bits(grad)[~nan], bits(expected)[~nan])
    before = grad.clone()
    assert not kernel.scale_(grad[:, ::2], factor) and not kernel.scale_(grad, factor.double())
    assert not kernel.scale_(grad.to(torch.float16), factor)
    assert not kernel.scale_(grad, factor.clone().requires_grad_())
    assert torch.equal(bits(grad), bits(before))


def test_a_kernel_without_scaling_gets_torchs_mul():
    """A kernel is a callable first: one without ``scale_`` (a plain function) still trains, the backward's scaling
    then by ``mul_``."""
    kernel = FusedCrossEntropy({torch.float32: ISAS[0]})
    logits, labels = torch.randn(6, 50), torch.randint(0, 50, (6,))
    x = logits.clone().requires_grad_()
    loss, _ = token_cross_entropy(x, labels, lambda a, b, g: kernel(a, b, g))
    (loss * 0.25).backward()
    ref_loss, ref_grad = _reference(logits, labels, 0.25)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=2e-5, atol=0)
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=0, atol=1e-6)


def test_strided_rows_and_the_objectives_route():
    """Rows of a wider tensor are read by their stride; a model carrying the kernel (a DDP wrapper's inner model
    too) hands it to the loss, and the CLM objective's loss and gradients match the plain model's."""
    kernel = FusedCrossEntropy({torch.float32: ISAS[0]})
    wide = torch.randn(9, 40)
    labels = torch.randint(0, 33, (9,))
    x = wide[:, :33].clone().requires_grad_()
    rows = wide[:, :33].requires_grad_()
    assert rows.stride(0) == 40
    loss, _ = token_cross_entropy(rows, labels, kernel)
    loss.backward()
    ref_loss, ref_grad = _reference(x.detach(), labels, 1.0)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=2e-5, atol=0)
    torch.testing.assert_close(rows.grad.double(), ref_grad, rtol=0, atol=1e-6)
    assert kernel(wide[:, :33], labels, torch.empty(9, 33)) is not None  # taken by its stride, not copied

    plain, ours = tiny_model(), tiny_model()
    calls = []

    class Spy:  # the kernel, with its calls recorded: the forward's rows, then the backward's scaling
        def __call__(self, logits, labels, grad):
            calls.append(tuple(logits.shape))
            return kernel(logits, labels, grad)

        def scale_(self, grad, factor):
            calls.append(("scale", tuple(grad.shape)))
            return kernel.scale_(grad, factor)

    ours.cross_entropy_kernel = spy = Spy()
    wrapper = torch.nn.Module()
    wrapper.module = ours
    assert cross_entropy_kernel(wrapper) is spy and cross_entropy_kernel(plain) is None
    objective = CausalLM(TOK)
    batch = objective.collate([TOK.encode("To be, or not to be"), TOK.encode("that is the question")])
    a, b = objective.loss(plain, batch), objective.loss(ours, batch)
    a.loss_sum.backward()
    b.loss_sum.backward()
    rows = (2 * batch["input_ids"].shape[1], TOK.vocab_size)
    assert calls == [rows, ("scale", rows)] and a.n_targets == b.n_targets
    torch.testing.assert_close(b.loss_sum, a.loss_sum, rtol=1e-5, atol=0)
    for (name, p), q in zip(plain.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "all -inf"])
def test_a_bad_row_makes_a_nan_loss_and_gradient_as_torchs(dtype, bad):
    """A NaN or +inf logit, or a row of -inf only: NaN loss and a NaN gradient row (never a finite gradient beside a
    NaN loss, which a guard on the gradient alone would let through); the other rows keep torch's values."""
    logits = torch.randn(3, 16).to(dtype)
    if bad == "all -inf":
        logits[1] = float("-inf")
    else:
        logits[1, 4] = bad
    labels = torch.tensor([1, 2, 3])
    x, y = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours, _ = token_cross_entropy(x, labels, FusedCrossEntropy({dtype: ISAS[0]}))
    theirs = F.cross_entropy(y.float(), labels, reduction="none")
    ours.backward()
    theirs.sum().backward()
    assert ours.isnan() and theirs[1].isnan() and x.grad[1].isnan().all() and y.grad[1].isnan().all()
    torch.testing.assert_close(x.grad[[0, 2]].float(), y.grad[[0, 2]].float(), rtol=0, atol=4e-3)


def test_bad_targets_and_dtypes_not_chosen():
    kernel = FusedCrossEntropy({torch.float32: ISAS[0]})
    with pytest.raises(IndexError, match="outside"):
        token_cross_entropy(torch.randn(3, 10, requires_grad=True), torch.tensor([1, 10, 3]), kernel)
    bf16 = torch.randn(3, 10, dtype=torch.bfloat16, requires_grad=True)  # no bf16 build chosen: torch's route
    assert kernel(bf16, torch.tensor([1, 2, 3]), torch.empty(3, 10, dtype=torch.bfloat16)) is None
    assert token_cross_entropy(bf16, torch.tensor([1, 2, 3]), kernel)[0].isfinite()


def test_accelerate_puts_it_in_only_where_it_wins_and_restore_takes_it_out(monkeypatch):
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=16)
    monkeypatch.setattr(accel_ce, "time_cross_entropy",
                        lambda rows, vocab, dtype, c: {**dict.fromkeys(c, 0.5), "torch": 1.0})
    model = accelerate(build_model(cfg), "train", rows=32, dtype=None, seq_len=16)
    assert isinstance(model.cross_entropy_kernel, FusedCrossEntropy)
    assert "loss cross-entropy" in model.accel_plan.summary() and model.accel_plan.cross_entropy
    restore_plain(model)
    assert cross_entropy_kernel(model) is None
    # a kernel made slow is not taken
    monkeypatch.setattr(accel_ce, "time_cross_entropy",
                        lambda rows, vocab, dtype, c: {**dict.fromkeys(c, 2.0), "torch": 1.0})
    model = accelerate(build_model(cfg), "train", rows=32, dtype=None, seq_len=16, use_cache=False)
    assert cross_entropy_kernel(model) is None and model.accel_plan.cross_entropy == ""


def test_real_timings_on_this_machine():
    timings = accel_ce.time_cross_entropy(64, 512, torch.float32,
                                          {"torch": None, ISAS[0]: FusedCrossEntropy({torch.float32: ISAS[0]})})
    assert set(timings) == {"torch", ISAS[0]} and all(t > 0 for t in timings.values())
