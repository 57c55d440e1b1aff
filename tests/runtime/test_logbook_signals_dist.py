import json
import os
import signal
import time

import pytest
import torch
from matplotlib.colors import to_hex

from seqlab.runtime import dist
from seqlab.runtime.logbook import Logbook
from seqlab.runtime.signals import GracefulStop


def test_logbook_appends_truncates_on_resume_and_plots(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with Logbook(path) as log:
        for s in range(1, 6):
            log.append({"step": s, "loss": 1.0 / s, "val": float("nan") if s == 2 else None})
    assert [r["step"] for r in Logbook(path, resume_step=3).rows()] == [1, 2, 3]
    assert json.loads(path.read_text().splitlines()[1])["val"] is None  # NaN is not JSON: written as null
    with open(path, "a") as f:
        f.write('{"step": 4, "lo')  # a torn last line from a crash
    log = Logbook(path, resume_step=3)
    log.append({"step": 4, "loss": 0.2})
    assert [r["step"] for r in log.rows()] == [1, 2, 3, 4]
    png = log.plot(tmp_path / "curve.png", "step", ["loss"], "loss (nats)", "t", hlines={"target": 0.1})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert log.plot(tmp_path / "none.png", "step", ["absent"], "y") is None
    assert Logbook(path).rows() == []  # a new log starts empty


def test_each_reference_level_has_its_own_colour_dash_and_legend_entry(tmp_path):
    log = Logbook(tmp_path / "energies.jsonl")
    for s in range(1, 4):
        log.append({"step": s, "energy": -1.0 - 0.01 * s})
    refs = {"HF -1.0167": -1.0167, "CCSD(T) -1.1372": -1.1372, "FCI -1.1373": -1.1373}
    fig = log.figure("step", ["energy"], "energy (Ha)", hlines=refs)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    styles = [(to_hex(lines[k].get_color()), lines[k].get_linestyle()) for k in refs]
    curve = to_hex(lines["energy"].get_color())
    assert len({c for c, _ in styles}) == len({d for _, d in styles}) == len(refs)
    assert curve not in {c for c, _ in styles}
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["energy", *refs]
    assert [line.get_ydata()[0] for line in map(lines.get, refs)] == list(refs.values())
    assert not Logbook(tmp_path / "other.jsonl", enabled=False).figure("step", ["energy"], "E")


def test_logbook_mirrors_numbers_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Logbook(tmp_path / "m.jsonl", tensorboard_dir=tmp_path / "tb") as log:
        for s in (1, 2):
            log.append({"step": s, "loss": 3.0 - s, "note": "text is not mirrored"})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["loss"]
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 2.0), (2, 1.0)]


def test_graceful_stop_first_signal_requests_second_interrupts():
    with GracefulStop() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.exit_code == 143
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored on exit


def test_single_process_dist_is_a_no_op():
    info = dist.init_distributed(device="cpu")
    assert (info.rank, info.world_size, info.is_main, info.active) == (0, 1, True, False)
    t = torch.tensor([2.0])
    assert dist.all_reduce_sum(t, info) is t and dist.all_reduce_mean(t, info).item() == 2.0
    assert dist.gather_bytes(b"abc", info) == [b"abc"] and dist.any_rank(True, info)
    dist.barrier(info)
    dist.shutdown(info)


def test_asking_for_a_missing_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="--device cuda: this torch sees no CUDA GPU"):
        dist.resolve_device("cuda")
    with pytest.raises(ValueError, match="--device mps: seqlab runs on auto, cpu, cuda or cuda:N"):
        dist.resolve_device("mps")
    with pytest.raises(ValueError, match="--device gpu: not a device"):
        dist.resolve_device("gpu")
    assert dist.resolve_device("auto") == torch.device("cpu")


def _two_rank_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    info = dist.init_distributed(device="cpu")
    got = {
        "sum": dist.all_reduce_sum(torch.tensor([rank + 1.0]), info).item(),
        "mean": dist.all_reduce_mean(torch.tensor([rank + 1.0]), info).item(),
        "gather": [b.decode() for b in dist.gather_bytes(b"r" * (rank + 1), info)],
        "any": dist.any_rank(rank == 1, info),
        "bcast": dist.broadcast_float(float(rank + 7), info),
    }
    dist.barrier(info)
    dist.shutdown(info)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(got, f)


def test_two_gloo_ranks_agree(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_two_rank_worker, args=(port, str(tmp_path / "r")), nprocs=2)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"r.{rank}").read_text())
        assert got == {"sum": 3.0, "mean": 1.5, "gather": ["r", "rr"], "any": True, "bcast": 7.0}


PEER_LATE_ON_ERROR_S = 8.0


def _shutdown_worker(rank: int, port: int, out: str, on_error: bool) -> None:
    """Rank 1 reaches shutdown late (1 s, or 8 s when rank 0 raises); rank 0 times its own shutdown, normally or
    while raising."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    info = dist.init_distributed(device="cpu")
    dist.barrier(info)
    if rank == 1:
        time.sleep(PEER_LATE_ON_ERROR_S if on_error else 1.0)
        dist.shutdown(info, timeout_s=20)
        return
    start = time.perf_counter()
    try:
        try:
            if on_error:
                raise KeyError("a failure on its way out")
        finally:
            dist.shutdown(info)  # with on_error, while the KeyError propagates
    except KeyError:
        pass
    waited = time.perf_counter() - start
    with open(out, "w") as f:
        json.dump({"waited": waited}, f)


@pytest.mark.parametrize("on_error", [False, True])
def test_shutdown_waits_for_the_peer_except_on_an_error_path(tmp_path, on_error):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_shutdown_worker, args=(port, str(tmp_path / "r0"), on_error), nprocs=2)
    waited = json.loads((tmp_path / "r0").read_text())["waited"]
    if on_error:  # no barrier while raising: the peer may never come. A barrier would have waited 8 s; the margin
        # is for gloo's teardown on a loaded machine (3.3 s once, with the suite running on both cores)
        assert waited < PEER_LATE_ON_ERROR_S / 2, waited
    else:
        assert waited > 0.8, waited  # met the late peer before tearing gloo down
