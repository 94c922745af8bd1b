"""``shmemx run --deepep``: DeepEP's scripts unchanged (``launcher/deepep.py``, ``launcher/cuda_cpu.py``), and the
DeepEP pieces the mode needs (``deep_ep.utils.*``, ``ElasticBuffer``, shrink mode, the kernels' times).

The scripts in ``tests/deepep_scripts`` are this project's own, written in the shape of DeepEP's tests
(``init_dist(local_rank, num_local_ranks)``, ``torch.multiprocessing.spawn``, ``device='cuda'``, nccl); they run
through the real ``shmemx run --deepep`` command. DeepEP's own files are not in this repository: point
``SHMEMX_DEEPEP_DIR`` at a DeepEP checkout (dd758ca or later) to run its tests too (slow: ``-m slow``).
Everything here needs torch and is skipped without it. The 4-rank script runs take 30-60 s each on a 2-core
machine: they are marked slow (``-m slow``); CI runs the pure parts and the 2-rank V2 script.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from shmemx import deep_ep  # noqa: E402
from shmemx.deep_ep import kernel_times  # noqa: E402
from shmemx.deep_ep.utils import math as dmath  # noqa: E402
from shmemx.deep_ep.utils import testing  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent / "deepep_scripts"
SHMEMX = [sys.executable, "-m", "shmemx"]
DEEPEP_DIR = os.environ.get("SHMEMX_DEEPEP_DIR")


def _run(args: list[str], cwd: Path, timeout: float = 240, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHMEMX_")}
    clean.update(env)
    return subprocess.run(SHMEMX + args, cwd=cwd, env=clean, capture_output=True, text=True, timeout=timeout)


def _deepep(n: int, script: str, *args: str, tmp_path: Path, extra=(), **env) -> subprocess.CompletedProcess:
    return _run(["run", "-n", str(n), "--timeout", "200", "--dump-dir", str(tmp_path), *extra, "--deepep",
                 str(SCRIPTS / script), "--num-processes", str(n), *args], tmp_path, **env)


# --- the pieces, without a job --------------------------------------------------------------------------------


def test_topk_idx_t_is_torchs_once_torch_is_there():
    assert deep_ep.topk_idx_t is torch.int64


def test_per_token_cast_back_reads_scales_by_element_count():
    x = torch.randn((6, 512)).to(torch.bfloat16)
    data, scales = deep_ep.utils.per_token_cast_to_fp8(x)
    assert scales.shape == (6, 4)
    flat = deep_ep.utils.per_token_cast_back(data, scales.reshape(-1))  # any shape of T * H/128 scales
    assert torch.equal(flat, deep_ep.utils.per_token_cast_back(data, scales))
    with pytest.raises(ValueError, match="need 24 scales"):
        deep_ep.utils.per_token_cast_back(data, scales[:3])


def test_buffer_signature_is_deepeps():
    names = list(inspect.signature(deep_ep.Buffer.__init__).parameters)[1:11]
    assert names == ["group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                     "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "explicitly_destroy", "enable_shrink",
                     "comm"]
    assert inspect.signature(deep_ep.Buffer.__init__).parameters["use_fabric"].kind == inspect.Parameter.KEYWORD_ONLY
    assert hasattr(deep_ep.Buffer, "get_local_buffer_tensor")
    for name in ("low_latency_query_mask_buffer", "low_latency_update_mask_buffer", "low_latency_clean_mask_buffer"):
        assert hasattr(deep_ep.Buffer, name)


def test_math_helpers():
    assert dmath.align(129, 128) == 256 and dmath.ceil_div(7, 2) == 4 and dmath.safe_div(0, 0) == 0
    with pytest.raises(ZeroDivisionError):
        dmath.safe_div(1, 0)
    t = torch.arange(8, dtype=torch.int32)
    assert dmath.count_bytes(t, (t, None)) == 64
    assert dmath.hash_tensors(t, [t]) == 0


def test_bench_kineto_answers_with_the_kernels_own_times():
    def fn():  # two kernels named as DeepEP names them, the second a hooked receive
        kernel_times.record("dispatch", 0.002)
        kernel_times.record("dispatch", 0.001)
        kernel_times.record("notify_dispatch", 0.0005)

    assert testing.bench_kineto(fn, "dispatch", num_tests=4) == pytest.approx(0.0015)
    send, recv = testing.bench_kineto(fn, ("dispatch",), num_tests=4, num_kernels_per_period=2)[0]
    assert (send, recv) == (pytest.approx(0.002), pytest.approx(0.001))
    assert testing.bench_kineto(fn, ("notify", "combine"), num_tests=2) == [pytest.approx(0.0005), 0]
    with kernel_times.collect() as c:
        with kernel_times.timed("barrier"):
            pass
    assert c.names() == ["barrier"] and c.durations("barrier")[0] >= 0


def test_the_v2_reference_combine_places_a_ranks_sum_at_its_last_slot():
    from shmemx.deep_ep.utils import refs

    y = torch.tensor([[[1.0], [2.0 ** -9], [2.0 ** -9], [4.0]]]).to(torch.bfloat16)  # [T=1, K=4, H=1]
    idx = torch.tensor([[0, 2, 0, 3]])  # experts 0, 2 on rank 0 (2 per rank), 3 on rank 1
    # rank 0's slots 0, 1, 2 sum to 1 + 2^-8 (exact in float32, 1 in bfloat16), at slot 2; then 4
    got = refs.combine(y, idx, 1, 2, 4, None, True, False)
    assert got.item() == 5.0
    assert refs.ordered_accumulate(y).item() == 5.0


@pytest.mark.parametrize("tokens, experts, ranks, topk, ratio", [(1024, 64, 8, 6, 2.0), (512, 16, 4, 4, 1.0),
                                                                 (256, 72, 72, 1, 4.0), (300, 64, 16, 9, 4.0)])
def test_precise_unbalanced_scores_give_rank_0_its_ratio_exactly(tokens, experts, ranks, topk, ratio):
    from shmemx.deep_ep.utils import gate

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as DeepEP's init_dist leaves it: the scores stay float32
    try:
        scores = gate.get_unbalanced_scores(tokens, experts, ranks, topk, ratio, True)
    finally:
        torch.set_default_dtype(default)
    assert scores.shape == (tokens, experts) and scores.dtype == torch.float32
    rank = torch.topk(scores, topk, dim=-1, sorted=False).indices // (experts // ranks)
    counts = torch.zeros((tokens, ranks), dtype=torch.bool).scatter_(1, rank, True).sum(0)
    assert counts[1:].max() - counts[1:].min() <= 1  # the other ranks within one token of each other
    assert abs(counts[0].item() / counts[1:].float().mean().item() - ratio) / ratio < 0.1
    with pytest.raises(ValueError, match="need at least 4 ranks per token"):
        gate.get_unbalanced_scores(64, 4, 4, 4, 2.0, True)  # 1 expert per rank, but ratio 2 allows 2 ranks


# --- through shmemx run --deepep --------------------------------------------------------------------------------


@pytest.mark.slow
def test_legacy_script_runs_unchanged(tmp_path):
    proc = _deepep(4, "legacy_roundtrip.py", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[pe 0] legacy ok" in proc.stdout


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_elastic_script_matches_the_reference_bit_for_bit(n, tmp_path):
    proc = _deepep(n, "elastic_roundtrip.py", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[pe 0] elastic ok" in proc.stdout


@pytest.mark.parametrize("n, nodes, multiple", [(2, 2, 1), (2, 1, 0), pytest.param(4, 2, 1, marks=pytest.mark.slow),
                                                pytest.param(4, 2, 0, marks=pytest.mark.slow)])
def test_elastic_script_takes_the_hybrid_route_over_nodes(n, nodes, multiple, tmp_path):
    """A job of several nodes (spawn's nprocs below the ranks): scale-out x scale-up, DeepEP's hybrid recipe; and
    without multiple reduction (one reduction, at the source), on either route."""
    proc = _deepep(n, "elastic_roundtrip.py", "--num-processes", str(n // nodes), "--allow-multiple-reduction",
                   str(multiple), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[pe 0] elastic ok" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("nprocs", [2, 1])
def test_elastic_script_under_check_and_chaos(nprocs, tmp_path):
    """The mode is the one path: the sanitizer and the chaos scheduler see its kernels like any other (the direct
    route, and the hybrid one over 2 nodes of 1 rank)."""
    proc = _deepep(2, "elastic_roundtrip.py", "--num-processes", str(nprocs), tmp_path=tmp_path,
                   extra=["--check", "--chaos", "7"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--check: no findings" in proc.stderr


@pytest.mark.slow
def test_shrink_mode_masks_a_rank_that_stops_calling(tmp_path):
    proc = _deepep(4, "shrink.py", tmp_path=tmp_path, SHMEMX_SHRINK_TIMEOUT="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[pe 0] shrink ok" in proc.stdout


def test_unmapped_cuda_calls_are_refused_by_name(tmp_path):
    proc = _run(["run", "-n", "1", "--dump-dir", str(tmp_path), "--deepep", str(SCRIPTS / "refused.py")], tmp_path)
    assert proc.returncode == 1
    assert "torch.cuda.memory_allocated has no CPU mapping" in proc.stderr


def test_spawn_must_cover_the_job_in_whole_nodes(tmp_path):
    proc = _run(["run", "-n", "1", "--dump-dir", str(tmp_path), "--deepep", str(SCRIPTS / "shrink.py"),
                 "--num-processes", "2"], tmp_path)
    assert proc.returncode == 1
    assert "the job's 1 ranks are not whole nodes of 2 processes" in proc.stderr


def test_deep_ep_resolves_to_shmemx_even_beside_a_checkout(tmp_path):
    fake = tmp_path / "deep_ep"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('the checkout was imported')\n")
    (tmp_path / "probe.py").write_text(
        "import os, deep_ep, deep_ep.utils.envs as envs, torch\n"
        "assert deep_ep.__name__ == 'shmemx.deep_ep', deep_ep.__name__\n"
        "assert torch.ones(2, device='cuda').device.type == 'cpu' and torch.zeros(1).cuda().device.type == 'cpu'\n"
        "print(os.environ['WORLD_SIZE'], os.environ['RANK'], os.environ['MASTER_ADDR'], flush=True)\n")
    proc = _run(["run", "-n", "1", "--no-tag-output", "--deepep", "probe.py"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["1 0 127.0.0.1"]


def test_without_the_mode_deep_ep_is_not_importable(tmp_path):
    (tmp_path / "probe.py").write_text("import importlib.util, sys; sys.exit(importlib.util.find_spec('deep_ep') "
                                       "is not None)\n")
    assert _run(["run", "-n", "1", "probe.py"], tmp_path).returncode == 0


# --- DeepEP's own tests, from a checkout (SHMEMX_DEEPEP_DIR) --------------------------------------------------

DEEPEP_CASES = {  # test file, ranks, its own options for small sizes, extra environment
    "barrier": ("tests/elastic/test_barrier.py", 4, [], {}),
    "pp": ("tests/elastic/test_pp.py", 4, ["--num-tokens", "32", "--hidden", "256", "--num-sends", "16",
                                          "--num-stress-iterations", "2"], {}),
    "ep": ("tests/elastic/test_ep.py", 4, ["--num-tokens", "32", "--hidden", "256", "--num-topk", "4",
                                          "--num-experts", "16"], {}),
    "ep_hybrid": ("tests/elastic/test_ep.py", 4, ["--num-tokens", "32", "--hidden", "256", "--num-topk", "4",
                                                 "--num-experts", "16", "--num-processes", "2"], {}),  # 2 x 2
    "intranode": ("tests/legacy/test_intranode.py", 4, ["--num-tokens", "64", "--hidden", "256", "--num-topk", "4",
                                                        "--num-experts", "32"], {}),
    "shrink": ("tests/legacy/test_low_latency.py", 6, ["--num-tokens", "16", "--hidden", "512", "--num-topk", "4",
                                                       "--num-experts", "24", "--shrink-test"], {}),
}


@pytest.mark.slow
@pytest.mark.skipif(not DEEPEP_DIR, reason="set SHMEMX_DEEPEP_DIR to a DeepEP checkout to run its own tests")
@pytest.mark.parametrize("case", DEEPEP_CASES)
def test_deepeps_own_tests(case, tmp_path):
    path, n, options, env = DEEPEP_CASES[case]
    script = Path(DEEPEP_DIR) / path
    if not script.exists():
        pytest.skip(f"{script} is not in the checkout")
    proc = _run(["run", "-n", str(n), "--timeout", "1500", "--dump-dir", str(tmp_path), "--deepep", str(script),
                 "--num-processes", str(n), *options], script.parent, timeout=1600, SHMEMX_DEEPEP_BENCH="1", **env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert np.all([("Error" not in line) for line in proc.stdout.splitlines()])
