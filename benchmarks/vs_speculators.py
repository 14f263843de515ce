"""draftsmith's training beside vllm-project/speculators 0.9.0, same data, same draft shape, side by side in one run.

    .venv/bin/python benchmarks/vs_speculators.py --quick          # 48 conversations, 10 MT-bench prompts x 64
    .venv/bin/python benchmarks/vs_speculators.py                  # 240 conversations x 2 epochs, 80 prompts x 128
    .venv/bin/python benchmarks/vs_speculators.py --quick --profile  # + where each trainer's step time goes

What it does:
 1. The peer: speculators==0.9.0 in its own venv, $DRAFTSMITH_CACHE/peers/speculators-0.9.0 (made on first use,
    installing exactly what its trainer imports; listed as it installs).
 2. The data: `draftsmith prepare` (embedded ShareGPT, SmolLM2-135M-Instruct, max length 1024) and `draftsmith
    extract` (hf backend, bf16 store), cached under $DRAFTSMITH_CACHE/bench/vs-speculators/. The store is written
    out in speculators' on-disk format (peers/speculators_data.py): same samples, same hidden states, and the
    rows ordered so that both trainers hold out exactly draftsmith's held-out samples.
 3. Training: both train the same shape (1 decoder layer, draft vocab 8192, 3 TTT steps, sequence length 1024:
    draftsmith --token-budget 1024, speculators --total-seq-len 1024) for the same epochs over the same training
    samples, each with its own optimizer, schedule and loss (draftsmith: its quickstart `small` recipe, AdamW lr
    2e-3, warm-up 20, cosine; speculators: its defaults, Muon + AdamW lr 1e-3, linear). speculators runs through
    peers/speculators_train.py (CPU patches applied at run time). Both processes live at once but only one runs:
    the other is stopped (SIGSTOP) and they take turns every --slice-s seconds, so machine load hits both alike.
    Precision (--precision best, the default): each at its best on this CPU -- bf16 autocast where the CPU computes
    bf16 natively (AVX512-BF16 or AMX, as torch reports it), fp32 elsewhere; the CPU and its flags go in the JSON.
    tokens/s = training tokens over the time each was running, from its second logged step to its last, without
    the intervals holding an evaluation or checkpoint. Each logs as it does by default: speculators every step,
    draftsmith every 10 (--ours-log-every; a logged step of draftsmith's also runs the target's whole lm_head for
    its full-vocabulary metrics, so --ours-log-every 1 measures it with that cost at every step).
 4. Held-out step-0..2 accuracy of both final drafts on the same held-out samples, by one evaluator and one
    definition (peers/speculators_eval.py: draftsmith's definition, both drafts run by speculators' model code;
    draftsmith's draft via `export --format speculators`); each trainer's own held-out numbers are kept beside.
 5. τ in vLLM (k = 3, temperature 0, MT-bench first turns; draftsmith.evaluate.vllm_runner, the measurement
    `draftsmith evaluate --engine vllm` makes): draftsmith's `export --format vllm` directory and speculators' own checkpoint directory.
 6. --profile: each trainer again for 8 steps with peers/profile_hook.py (phase times and a torch profiler table).

Last line: JSON with tokens_per_s_ours, tokens_per_s_peer, ratio (ours / peer), acc_ours, acc_peer (step 0..2),
tau_ours, tau_peer and the settings.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = HERE / "peers"
SPECULATORS = "speculators==0.9.0"
# Pinned beside speculators (installed with --no-deps): torch first (the CPU build on local disk; an unpinned torch
# pulls a multi-GB CUDA build), then what its trainer imports (speculators.train.*: datasets' load_from_disk,
# openai + httpx for on-demand generation, pydantic-settings for its config, loguru for logging; hs-connectors
# is its hidden-state file reader). torchvision / torchaudio / the mooncake extras are declared but not imported.
PEER_BASE = ["torch==2.13.0", "transformers==5.19.0"]
PEER_EXTRAS = ["datasets==5.1.0", "openai==3.57.0", "httpx==0.28.1", "loguru==0.7.3", "pydantic-settings==2.16.3"]
PEER_NODEPS = [SPECULATORS, "hs-connectors==0.9.0"]
PEER_ENV_VERSION = "v1"
DATA_VERSION = "v1"
SEQ_LEN, DRAFT_VOCAB, TTT_STEPS, NUM_LAYERS = 1024, 8192, 3, 1


def log(msg: str) -> None:
    print(f"[vs-speculators {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def cache_dir() -> Path:
    return Path(os.environ.get("DRAFTSMITH_CACHE") or Path.home() / ".cache" / "draftsmith").expanduser()


def run(cmd: list[str], *, log_file: Path | None = None, env: dict | None = None, timeout: float | None = None):
    """Run a command; on failure show the end of its output and stop."""
    if log_file is None:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        out = proc.stdout + proc.stderr
    else:
        with open(log_file, "w", encoding="utf-8") as f:
            proc = subprocess.run(
                cmd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False
            )
        out = log_file.read_text(encoding="utf-8", errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(out.strip().splitlines()[-25:])
        raise SystemExit(f"failed (exit {proc.returncode}): {' '.join(map(str, cmd))}\n{tail}")
    return proc.stdout if log_file is None else out


# ---------------------------------------------------------------------------------------------- the peer's venv


def peer_python() -> Path:
    """The peer venv's python, made on first use (under a lock: two benchmarks may start at once)."""
    root = cache_dir() / "peers" / "speculators-0.9.0"
    py = root / "bin" / "python"
    marker = root / "draftsmith-peer.json"
    want = {"version": PEER_ENV_VERSION, "base": PEER_BASE, "extras": PEER_EXTRAS, "no_deps": PEER_NODEPS}
    if marker.is_file() and json.loads(marker.read_text()) == want and py.exists():
        return py
    (cache_dir() / "locks").mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / "locks" / "peer-speculators-0.9.0.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file() and json.loads(marker.read_text()) == want and py.exists():
            return py
        shutil.rmtree(root, ignore_errors=True)
        log(f"making the peer's venv {root} (once): python -m venv, then pip install")
        log(f"  {' '.join(PEER_BASE)}")
        log(f"  {' '.join(PEER_EXTRAS)}")
        log(f"  --no-deps {' '.join(PEER_NODEPS)}")
        python = shutil.which("python3.11") or sys.executable
        run([python, "-m", "venv", str(root)])
        pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        run(pip + PEER_BASE, timeout=3600)
        run(pip + PEER_EXTRAS, timeout=3600)
        run(pip + ["--no-deps"] + PEER_NODEPS, timeout=3600)
        run([str(py), "-c", "import speculators.train.cli, speculators.models.eagle3.core, hs_connectors"])
        marker.write_text(json.dumps(want))
    return py


# ---------------------------------------------------------------------------------------------- data


def draftsmith_cmd() -> list[str]:
    return [sys.executable, "-m", "draftsmith"]


def make_data(conversations: int) -> tuple[Path, Path, dict]:
    """(prepared set, store, store manifest): prepared and extracted once per size, cached."""
    root = cache_dir() / "bench" / "vs-speculators" / f"data-{DATA_VERSION}-c{conversations}-l{SEQ_LEN}"
    prepared, store = root / "prepared", root / "store"
    root.mkdir(parents=True, exist_ok=True)
    if not (prepared / "manifest.json").is_file():
        log(f"draftsmith prepare: {conversations} embedded ShareGPT conversations, max length {SEQ_LEN}")
        run(
            draftsmith_cmd()
            + ["prepare", "--max-length", str(SEQ_LEN), "--max-samples", str(conversations), "--output", str(prepared)],
            log_file=root / "prepare.log",
        )
    num_samples = json.loads((prepared / "manifest.json").read_text())["num_samples"]
    manifest = json.loads((store / "manifest.json").read_text()) if (store / "manifest.json").is_file() else {}
    if manifest.get("num_samples") != num_samples:
        log(f"draftsmith extract: {num_samples} samples, hf backend, bf16 store (~3 min per 64 on a quiet machine)")
        t0 = time.perf_counter()
        # the target in float32 on every CPU kind (`auto` would be bf16 on a bf16 CPU): the same data everywhere
        run(
            draftsmith_cmd()
            + [
                "extract",
                "--prepared",
                str(prepared),
                "--output",
                str(store),
                "--device",
                "cpu",
                "--compute-dtype",
                "float32",
            ],
            log_file=root / "extract.log",
        )
        log(f"  extracted in {time.perf_counter() - t0:.0f} s")
        manifest = json.loads((store / "manifest.json").read_text())
    return prepared, store, manifest


def split(num_samples: int, eval_fraction: float) -> tuple[list[int], list[int]]:
    """draftsmith's own train / held-out split of sample ids (the one its trainer and evaluator share)."""
    from draftsmith.prepare.dataset import split_indices

    train, held = split_indices(num_samples, eval_fraction, 0)
    return sorted(train), sorted(held)


def make_peer_data(py: Path, store: Path, train: list[int], held: list[int]) -> Path:
    order = train + held
    out = store.parent / f"speculators-data-{len(train)}+{len(held)}"
    done = out / "draftsmith-order.json"
    if done.is_file() and json.loads(done.read_text()) == order:
        return out
    shutil.rmtree(out, ignore_errors=True)
    log(f"writing the store in speculators' format: {out}")
    run([str(py), str(PEERS / "speculators_data.py"), str(store), str(out), "--order", ",".join(map(str, order))])
    done.write_text(json.dumps(order))
    return out


# ---------------------------------------------------------------------------------------------- side by side


class Job:
    """A trainer process that runs only while it holds the turn (SIGSTOP / SIGCONT on its process group)."""

    def __init__(self, name: str, cmd: list[str], step_log: Path, out_log: Path, env: dict):
        self.name, self.step_log = name, step_log
        self._out = open(out_log, "w", encoding="utf-8")  # noqa: SIM115 - closed in finish()
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.pause()
        self.active = 0.0  # seconds it has been allowed to run
        self.records: list[tuple[float, dict]] = []  # (active time when seen, parsed line)
        self.loads: list[float] = []
        self._pos = 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _signal(self, sig) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def poll(self, now_active: float) -> None:
        if not self.step_log.is_file():
            return
        with open(self.step_log, "rb") as f:
            f.seek(self._pos)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._pos += len(complete)
        for line in complete.decode("utf-8").splitlines():
            if line.strip():
                self.records.append((now_active, json.loads(line)))

    def finish(self) -> int:
        self.resume()
        code = self.proc.wait()
        self._out.close()
        return code

    def throughput(self) -> dict:
        """tokens/s over the running time between consecutive logged steps, from the 2nd logged step on; an
        interval that holds an evaluation line (evaluation, checkpoint) is left out."""
        tokens = seconds = 0.0
        prev, dirty, steps = None, False, 0
        for t, rec in self.records:
            if rec.get("type") == "eval":
                dirty = True
                continue
            if rec.get("type") != "train":
                continue
            if prev is not None and not dirty:
                tokens += rec["tokens_seen"] - prev[1]["tokens_seen"]
                seconds += t - prev[0]
                steps += 1
            prev, dirty = (t, rec), False
        train = [r for _, r in self.records if r.get("type") == "train"]
        return {
            "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
            "timed_steps": steps,
            "timed_s": round(seconds, 1),
            "steps": len(train),
            "tokens_seen": train[-1]["tokens_seen"] if train else 0,
            "active_s": round(self.active, 1),
            "load_avg_while_running": round(sum(self.loads) / len(self.loads), 2) if self.loads else None,
        }


def side_by_side(jobs: list[Job], slice_s: float) -> None:
    """Give each live job the machine for slice_s seconds in turn until all have exited."""
    turn = 0
    while any(j.alive() for j in jobs):
        job = jobs[turn % len(jobs)]
        turn += 1
        if not job.alive():
            continue
        job.resume()
        t0 = time.monotonic()
        while job.alive() and time.monotonic() - t0 < slice_s:
            time.sleep(0.1)
            job.poll(job.active + time.monotonic() - t0)
        job.active += time.monotonic() - t0
        job.loads.append(loadavg())
        if job.alive():
            job.pause()
        job.poll(job.active)


def train_both(args, py: Path, store: Path, peer_data: Path, target: str, n_train: int, n: int, work: Path):
    ours_dir, peer_dir = work / "ours", work / "peer"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    ours_cmd = draftsmith_cmd() + [
        "train",
        "--data",
        str(store),
        "--output",
        str(ours_dir),
        "--draft-vocab-size",
        str(DRAFT_VOCAB),
        "--ttt-steps",
        str(TTT_STEPS),
        "--num-layers",
        str(NUM_LAYERS),
        "--token-budget",
        str(SEQ_LEN),
        "--lr",
        str(args.ours_lr),
        "--warmup-steps",
        str(args.ours_warmup),
        "--epochs",
        str(args.epochs),
        "--eval-fraction",
        str(args.eval_fraction),
        "--log-every",
        str(args.ours_log_every),
        "--save-every",
        "1000000",
        "--device",
        "cpu",
        "--precision",
        args.precisions["ours"],
    ]
    peer_cmd = [str(py), str(PEERS / "speculators_train.py")] + peer_args(
        target, peer_data, peer_dir, n_train, n, args.epochs, args.precisions["peer"]
    )
    peer_dir.mkdir(parents=True, exist_ok=True)
    log(f"training side by side, {args.slice_s:.0f}-second turns: draftsmith -> {ours_dir}, speculators -> {peer_dir}")
    jobs = [
        Job("ours", ours_cmd, ours_dir / "metrics.jsonl", work / "ours.log", env),
        Job(
            "peer",
            peer_cmd,
            peer_dir / "steps.jsonl",
            work / "peer.log",
            dict(env, STEP_LOG=str(peer_dir / "steps.jsonl")),
        ),
    ]
    t0 = time.perf_counter()
    try:
        side_by_side(jobs, args.slice_s)
    finally:
        codes = {j.name: j.finish() for j in jobs}
    for job in jobs:
        if codes[job.name] != 0:
            tail = "\n".join((work / f"{job.name}.log").read_text(errors="replace").splitlines()[-25:])
            raise SystemExit(f"{job.name} trainer failed (exit {codes[job.name]}):\n{tail}")
    log(f"  both trained in {time.perf_counter() - t0:.0f} s wall")
    (work / "timeline.json").write_text(json.dumps({j.name: j.records for j in jobs}))  # (running s, log line)
    return {j.name: j.throughput() for j in jobs}, {j.name: j.records for j in jobs}


def peer_args(
    target: str,
    data: Path,
    out: Path,
    n_train: int,
    n: int,
    epochs: int,
    hidden_states_dtype: str,
    max_steps: int | None = None,
):
    args = [
        "--verifier-name-or-path",
        target,
        "--data-path",
        str(data),
        "--save-path",
        str(out / "checkpoints"),
        "--log-dir",
        str(out / "logs"),
        "--total-seq-len",
        str(SEQ_LEN),
        "--draft-vocab-size",
        str(DRAFT_VOCAB),
        "--ttt-steps",
        str(TTT_STEPS),
        "--num-layers",
        str(NUM_LAYERS),
        "--epochs",
        str(epochs),
        "--train-data-ratio",
        repr((n_train + 0.5) / n),
        "--num-workers",
        "0",
        "--on-missing",
        "raise",
        # CPU: flex attention and the Triton-fused loss need a GPU. --hidden-states-dtype is also its autocast
        # dtype (and the weights' dtype when it saves): bfloat16 is its default, float32 its choice on a CPU
        # without native bf16 (best_precisions)
        "--draft-attn-impl",
        "sdpa",
        "--loss-implementation",
        "eager",
        "--hidden-states-dtype",
        hidden_states_dtype,
    ]
    return args + (["--max-steps", str(max_steps)] if max_steps else [])


# ---------------------------------------------------------------------------------------------- results


def best_precisions(asked: str) -> dict:
    """Each trainer's precision flag: `best` is bf16 where this CPU computes it natively (core.hardware: AVX512-BF16
    or AMX), fp32 elsewhere (emulated bf16 is slower than fp32) -- draftsmith's `--precision auto`, speculators'
    default `--hidden-states-dtype bfloat16` or float32. `fp32` / `bf16` force both."""
    from draftsmith.core import hardware

    bf16 = hardware.native_bf16() if asked == "best" else asked == "bf16"
    return {
        "ours": "auto" if asked == "best" else asked,
        "peer": "bfloat16" if bf16 else "float32",
        "resolved": "bf16" if bf16 else "fp32",
    }


def last_eval(records: list, key: str = "acc") -> list | None:
    evals = [r for _, r in records if r.get("type") == "eval"]
    if not evals:
        return None
    e = evals[-1]
    if key in e:
        return e[key]
    own = [e.get(f"full_acc_{k}_epoch") for k in range(TTT_STEPS)]
    return own if all(v is not None for v in own) else None


def ours_checkpoint(run_dir: Path) -> Path:
    """The last step's checkpoint (both drafts are compared as trained to the end, not at a best epoch)."""
    steps = sorted((run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").is_dir() else []
    return steps[-1] if steps else run_dir


def same_draft_vocab(a: Path, b: Path) -> bool:
    """Whether two drafts predict the same target ids (their t2d masks agree)."""
    from safetensors import safe_open

    masks = []
    for d in (a, b):
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            masks.append(f.get_tensor("t2d").bool())
    return bool((masks[0] == masks[1]).all())


def draftsmith_source() -> dict:
    """Which draftsmith ran: its package path and the repository's HEAD at the start (the tree may hold others'
    uncommitted work; to measure a commit, run with PYTHONPATH=<`git archive` of it>/src)."""
    import draftsmith

    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, check=False
    )
    return {
        "path": str(Path(draftsmith.__file__).parent),
        "head": head.stdout.strip() or None,
        "version": getattr(draftsmith, "__version__", None),
    }


def vllm_tau(draft: Path, target: str, prompts: list[list[int]], args, work: Path, name: str) -> dict:
    """τ of one EAGLE-3 draft directory in vLLM, measured as `draftsmith evaluate --engine vllm` measures it (its
    worker process, vLLM's own spec-decode counters over the timed call)."""
    from draftsmith.evaluate.vllm_runner import run_vllm, stats_from_vllm

    t0 = time.perf_counter()
    result = run_vllm(
        target=Path(target),
        draft=draft,
        prompts=prompts,
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        temperature=0.0,
        seed=0,
        dtype="float32",
        max_model_len=max(map(len, prompts)) + args.max_new_tokens + args.k + 8,
        kv_cache_gb=args.vllm_kv_cache_gb,
        timeout_s=args.vllm_timeout_s,
        workdir=work,
        name=f"vllm-{name}",
        max_num_seqs=args.vllm_max_num_seqs,
    )
    stats = stats_from_vllm(result, args.k)
    return {
        "tau": stats.tau,
        "drafts": stats.num_rounds,
        "accepted": stats.num_accepted,
        "acceptance_per_pos": stats.acceptance_per_pos,
        "new_tokens": stats.num_new_tokens,
        "elapsed_s": stats.elapsed_s,
        "tokens_per_s": stats.tokens_per_s,
        "outputs": result.outputs,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def profile_both(args, py: Path, store: Path, peer_data: Path, target: str, n_train: int, n: int, work: Path) -> dict:
    """Each trainer alone for 8 steps with profile_hook (2 warm-up, 4 timed, 2 under the torch profiler)."""
    out = work / "profile"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads), PROFILE=str(out))
    log(f"profiling each trainer for 8 steps -> {out}")
    run(
        [
            sys.executable,
            str(PEERS / "draftsmith_profile.py"),
            "train",
            "--data",
            str(store),
            "--output",
            str(out / "ours-run"),
            "--draft-vocab-size",
            str(DRAFT_VOCAB),
            "--ttt-steps",
            str(TTT_STEPS),
            "--token-budget",
            str(SEQ_LEN),
            "--lr",
            str(args.ours_lr),
            "--warmup-steps",
            str(args.ours_warmup),
            "--eval-fraction",
            str(args.eval_fraction),
            "--max-steps",
            "8",
            "--log-every",
            "1",
            "--device",
            "cpu",
            "--precision",
            args.precisions["ours"],
        ],
        log_file=out / "ours.log",
        env=env,
    )
    run(
        [str(py), str(PEERS / "speculators_train.py")]
        + peer_args(target, peer_data, out / "peer-run", n_train, n, 1, args.precisions["peer"], max_steps=8),
        log_file=out / "peer.log",
        env=dict(env, STEP_LOG=str(out / "peer-run" / "steps.jsonl")),
    )
    result = {}
    for name, key, steps in (
        ("draftsmith", "ours", out / "ours-run" / "metrics.jsonl"),
        ("speculators", "peer", out / "peer-run" / "steps.jsonl"),
    ):
        f = out / f"{name}.json"
        result[key] = json.loads(f.read_text()) if f.is_file() else None
        if result[key] and steps.is_file():  # tokens of the timed steps (3..6): profile_hook's window
            seen = {
                r["step"]: r["tokens_seen"]
                for r in map(json.loads, steps.read_text().splitlines())
                if r.get("type") == "train"
            }
            if 2 in seen and 6 in seen:
                per_step = (seen[6] - seen[2]) / 4
                result[key]["tokens_per_step"] = per_step
                result[key]["tokens_per_s"] = round(per_step / result[key]["step_s"], 1)
    result["tables"] = str(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="48 conversations, 1 epoch, 10 prompts x 64 tokens")
    parser.add_argument("--conversations", type=int, help="prepared conversations (quick 48, full 240)")
    parser.add_argument("--epochs", type=int, help="epochs for both (quick 1, full 2)")
    parser.add_argument("--eval-fraction", type=float, default=0.125, help="held-out fraction (draftsmith's split)")
    parser.add_argument("--ours-lr", type=float, default=2e-3, help="draftsmith lr (its quickstart small budget)")
    parser.add_argument("--ours-warmup", type=int, default=20, help="draftsmith warm-up steps (quickstart small)")
    parser.add_argument(
        "--ours-log-every",
        type=int,
        default=10,
        help=(
            "draftsmith's --log-every (its default, 10): its logged steps also compute the metrics over the target's "
            "full vocabulary (about 15 %% of such a step here); speculators computes its metrics at every step"
        ),
    )
    parser.add_argument("--slice-s", type=float, default=20.0, help="seconds each trainer runs per turn")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each trainer")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, help="MT-bench first turns (quick 10, full 80)")
    parser.add_argument("--max-new-tokens", type=int, help="tokens per prompt (quick 64, full 128)")
    parser.add_argument("--vllm-max-num-seqs", type=int, default=8, help="prompts vLLM decodes at once (τ only)")
    parser.add_argument("--vllm-kv-cache-gb", type=int, default=2)
    parser.add_argument("--vllm-timeout-s", type=int, default=3600)
    parser.add_argument("--skip-vllm", action="store_true", help="no τ (training and held-out accuracy only)")
    parser.add_argument("--profile", action="store_true", help="also profile each trainer (8 steps each)")
    parser.add_argument(
        "--precision",
        choices=["best", "fp32", "bf16"],
        default="best",
        help=("best: each trainer at its best precision on this CPU (bf16 where it computes bf16 natively, else fp32)"),
    )
    parser.add_argument("--work", type=Path, help="run directory (default $DRAFTSMITH_CACHE/bench/vs-speculators/run)")
    args = parser.parse_args()
    args.conversations = args.conversations or (48 if args.quick else 240)
    args.epochs = args.epochs or (1 if args.quick else 2)
    args.num_prompts = args.num_prompts or (10 if args.quick else 80)
    args.max_new_tokens = args.max_new_tokens or (64 if args.quick else 128)
    started, load_start, source = time.perf_counter(), loadavg(), draftsmith_source()
    args.precisions = best_precisions(args.precision)
    from draftsmith.core import hardware

    cpu = hardware.cpu_info()
    log(
        f"CPU: {cpu.describe()}; precision {args.precision}: draftsmith --precision {args.precisions['ours']}, "
        f"speculators --hidden-states-dtype {args.precisions['peer']}"
    )
    work = args.work or cache_dir() / "bench" / "vs-speculators" / "run"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    py = peer_python()
    prepared, store, manifest = make_data(args.conversations)
    target = manifest["target"]["path"]
    n = int(json.loads((prepared / "manifest.json").read_text())["num_samples"])
    train, held = split(n, args.eval_fraction)
    peer_data = make_peer_data(py, store, train, held)
    log(f"data: {n} samples ({manifest['num_tokens']:,} tokens), {len(train)} train / {len(held)} held out")

    speeds, records = train_both(args, py, store, peer_data, target, len(train), n, work)
    for name in ("ours", "peer"):
        log(f"  {name}: {speeds[name]}")
    (work / "speeds.json").write_text(json.dumps(speeds))

    log("exporting draftsmith's draft (vllm, speculators formats)")
    ckpt = ours_checkpoint(work / "ours")
    ours_vllm, ours_spec = work / "ours-vllm", work / "ours-speculators"
    run(draftsmith_cmd() + ["export", str(ckpt), "--format", "vllm", "--output", str(ours_vllm)])
    run(draftsmith_cmd() + ["export", str(ckpt), "--format", "speculators", "--output", str(ours_spec)])
    peer_ckpt = work / "peer" / "checkpoints" / str(args.epochs - 1)

    log("held-out accuracy of both drafts (one evaluator)")
    rows = ",".join(str(i) for i in range(len(train), n))
    out = run(
        [
            str(py),
            str(PEERS / "speculators_eval.py"),
            "--data",
            str(peer_data),
            "--rows",
            rows,
            "--target",
            target,
            "--threads",
            str(args.threads),
            str(ours_spec),
            str(peer_ckpt),
        ]
    )
    held_out = json.loads(out.strip().splitlines()[-1])
    acc_ours, acc_peer = held_out[str(ours_spec)], held_out[str(peer_ckpt)]
    log(f"  step 0..2 accuracy: ours {acc_ours['acc']}, peer {acc_peer['acc']}")
    (work / "held_out.json").write_text(json.dumps(held_out))

    taus: dict = {}
    if not args.skip_vllm:
        from draftsmith.core import targets as ds_targets
        from draftsmith.evaluate.prompts import load_prompts

        tokenizer = ds_targets.load_tokenizer(Path(target))
        prompts = [p.token_ids for p in load_prompts("mt-bench", tokenizer, num_prompts=args.num_prompts)]
        for name, draft in (("ours", ours_vllm), ("peer", peer_ckpt)):
            log(f"vLLM: τ of {name} ({draft}), {len(prompts)} prompts x {args.max_new_tokens} tokens, k={args.k}")
            taus[name] = vllm_tau(draft, target, prompts, args, work, name)
            log(
                f"  τ {taus[name]['tau']:.3f}, acceptance per position "
                f"{[round(a, 3) for a in taus[name]['acceptance_per_pos']]} ({taus[name]['wall_s']} s)"
            )

    profile = profile_both(args, py, store, peer_data, target, len(train), n, work) if args.profile else None

    ours_s, peer_s = speeds["ours"]["tokens_per_s"], speeds["peer"]["tokens_per_s"]
    summary = {
        "tokens_per_s_ours": ours_s,
        "tokens_per_s_peer": peer_s,
        "ratio": round(ours_s / peer_s, 3) if ours_s and peer_s else None,
        "acc_ours": acc_ours["acc"],
        "acc_peer": acc_peer["acc"],
        "tau_ours": round(taus["ours"]["tau"], 4) if taus else None,
        "tau_peer": round(taus["peer"]["tau"], 4) if taus else None,
        "acceptance_per_pos_ours": [round(a, 4) for a in taus["ours"]["acceptance_per_pos"]] if taus else None,
        "acceptance_per_pos_peer": [round(a, 4) for a in taus["peer"]["acceptance_per_pos"]] if taus else None,
        "held_out_positions": acc_ours["count"],
        "same_draft_vocab": same_draft_vocab(ours_spec, peer_ckpt),
        "acc_ours_trainer_eval": last_eval(records["ours"]),
        "acc_peer_own_metric": acc_peer["acc_own_metric"],
        "acc_ours_peer_metric": acc_ours["acc_own_metric"],
        "acc_peer_trainer_eval": last_eval(records["peer"]),
        "train_ours": speeds["ours"],
        "train_peer": speeds["peer"],
        "profile": profile,
        "cpu": cpu.as_dict(),
        "precision": {"asked": args.precision, **args.precisions},
        "settings": {
            "peer": SPECULATORS,
            "draftsmith": source,
            "conversations": n,
            "tokens": manifest["num_tokens"],
            "train_samples": len(train),
            "held_out_samples": len(held),
            "epochs": args.epochs,
            "seq_len": SEQ_LEN,
            "draft_vocab": DRAFT_VOCAB,
            "ttt_steps": TTT_STEPS,
            "num_layers": NUM_LAYERS,
            "ours_lr": args.ours_lr,
            "ours_warmup": args.ours_warmup,
            "ours_log_every": args.ours_log_every,
            "slice_s": args.slice_s,
            "threads": args.threads,
            "k": args.k,
            "num_prompts": args.num_prompts if taus else 0,
            "max_new_tokens": args.max_new_tokens,
            "vllm_max_num_seqs": args.vllm_max_num_seqs,
            "quick": args.quick,
            "load_avg_start": load_start,
            "load_avg_end": loadavg(),
            "wall_s": round(time.perf_counter() - started, 1),
            "work": str(work),
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
