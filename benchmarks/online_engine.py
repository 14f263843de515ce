"""Online training fed by live vLLM engines through a bounded spool, against extract-then-train, side by side.

One prepared set of the default target (the embedded SmolLM2 and ShareGPT), one seed, the same train options (the
quickstart's small budget unless overridden), each stage a subprocess of the installed CLI:

  A) offline   draftsmith extract --prepared P --output STORE --backend vllm
               draftsmith train --data STORE --output RUN_A
  B) online    draftsmith train --data P --engine vllm --spool-gb G --spool RUN_B/spool --output RUN_B
  C) Mooncake  draftsmith train --data P --engine vllm --spool-gb G --spool mooncake --output RUN_C
               (the same, through a Mooncake master draftsmith starts on loopback; --no-mooncake skips it)
  T) transport A's store published as one chunk by a process of its own into a Mooncake master on loopback, then
               fetched by this one: publish and fetch GB/s (the chunk's bytes over each side's wall seconds)

Wall seconds of every stage are measured here (interpreter, engine start-up and setup included); each stage's
own "tokens/s" (its summary: start-up excluded) is reported beside them. A sampling thread sums the file sizes
under STORE (during A's extract) and under RUN_B/spool (for the whole of B) every 20 ms, so the peak disk of
each is measured, not assumed; B's summary "spool peak (bytes)" is reported beside it. Training tokens are the
train summary's "tokens" (metrics.jsonl `tokens_seen` if the summary cannot be read).

    .venv/bin/python benchmarks/online_engine.py                   # 200 conversations, small-budget training
    .venv/bin/python benchmarks/online_engine.py --samples 40 --keep
    .venv/bin/python benchmarks/online_engine.py --samples 400 --spool-gb 0.05 --steps 200

Ratios (goals from issue 19):
    ratio_vs_slower_stage   B's tokens/s / min(A extract, A train tokens/s), each as its summary reports it
                            (goal >= 0.8: the engines and the trainer overlap, so B runs at its slower side's pace)
    ratio_vs_end_to_end     B's tokens / B's wall s over A's train tokens / (extract wall s + train wall s)
    disk_ratio              B's measured spool peak / A's store bytes (goal <= 0.10)
    mooncake_vs_directory   C's tokens/s / B's (the train summaries'), with each one's trainer wait beside it
`--spool-gb` (GiB) defaults to a tenth of the estimated store size, but never less than the trainer accepts:
SPOOL_CHUNKS chunks of one optimizer step each besides the held-out split's chunk. Prints a table on stderr; the
LAST stdout line is one JSON object. If B cannot run (`train --engine vllm` refuses, fails, or runs in another
mode than "online (vLLM engines, spool)"), its failure is one line in the table and `online.error` in the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GiB = 2**30  # the unit of --spool-gb
ONLINE_MODE = "online (vLLM engines, spool)"  # the train summary's "mode" of `train --engine vllm`
MOONCAKE_MODE = "online (vLLM engines, Mooncake)"  # ... of `train --engine vllm --spool mooncake`
PUBLISHER = """
import json, shutil, sys, time
from pathlib import Path
from draftsmith.extract.spool.mooncake import MooncakeAddress, MooncakeSpool, segment_bytes
store, address, scratch, size = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
spool = MooncakeSpool(MooncakeAddress.parse(address), segment=segment_bytes(size), scratch=scratch).connect()
partial = spool.begin("bench")
shutil.copytree(store, partial)
t0 = time.perf_counter()
spool.publish("bench")
print(json.dumps({"publish_s": time.perf_counter() - t0}), flush=True)
sys.stdin.readline()  # its segment holds the chunk until the reader is done
spool.close()
"""
THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")  # how the CLI prints a big number: 12,345
BOX = "│┃╭╮╰╯─━┌┐└┘╞╡═ "


class DiskPeak(threading.Thread):
    """Sums the sizes of the files under `root` every `interval` seconds until stopped; keeps the peak."""

    def __init__(self, root: Path, interval: float = 0.02):
        super().__init__(daemon=True)
        self.root, self.interval = Path(root), interval
        self.peak = self.last = self.samples = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.interval)

    def sample(self) -> None:
        self.last = tree_bytes(self.root)
        self.peak = max(self.peak, self.last)
        self.samples += 1

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.sample()  # what is left at the end


def tree_bytes(root: Path) -> int:
    """Sum of the sizes of the regular files under `root` (0 if it does not exist); files may vanish meanwhile."""
    total = 0
    stack = [str(root)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                pass
    return total


def parse_summary(text: str) -> dict:
    """The stage summary the CLI prints as a table (`│ key │ value │` rows), values as numbers where they are."""
    summary: dict = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) < 4 or not cells[1]:
            continue
        key, value = cells[1], cells[2]
        plain = value.replace(",", "") if THOUSANDS.match(value) else value  # "2,15,27" (layer ids) stays text
        for kind in (int, float):
            try:
                summary[key] = kind(plain)
                break
            except ValueError:
                summary[key] = value
    return summary


def failure_line(stderr: str, rc: int) -> str:
    """The one line a failed CLI call printed: its `error:` line, else the last line with text (box drawing off)."""
    lines = [line.strip(BOX) for line in stderr.splitlines() if not line.lstrip().startswith(("╭", "╰"))]
    lines = [line for line in lines if line]
    errors = [line for line in lines if line.lower().startswith("error")]
    return (errors or lines or [f"exit status {rc}, nothing on stderr"])[-1]


def run_stage(
    label: str, argv: list[str], env: dict, logs: Path, watch: Path | None = None, cores: str | None = None
) -> dict:
    """`python -m draftsmith ARGV` with its output in logs/LABEL.{out,err}: wall s, summary, error, disk peak;
    `cores`: pinned to those CPU cores (taskset -c)."""
    cmd = [sys.executable, "-m", "draftsmith", *argv]
    if cores is not None:
        cmd = ["taskset", "-c", cores, *cmd]
    print(f"{label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    sampler = DiskPeak(watch) if watch is not None else None
    out_path, err_path = logs / f"{label}.out", logs / f"{label}.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        if sampler:
            sampler.start()
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, check=False, stdout=out, stderr=err, env=env, stdin=subprocess.DEVNULL).returncode
        seconds = time.perf_counter() - t0
        if sampler:
            sampler.stop()
    result = {"wall_s": round(seconds, 1), "rc": rc, "summary": parse_summary(out_path.read_text())}
    if sampler:
        result.update(disk_peak_bytes=sampler.peak, disk_final_bytes=sampler.last, disk_samples=sampler.samples)
    if rc != 0:
        result["error"] = failure_line(err_path.read_text(errors="replace"), rc)
        print(f"{label}: FAILED after {seconds:.0f} s: {result['error']}", file=sys.stderr, flush=True)
    else:
        print(f"{label}: done in {seconds:.0f} s", file=sys.stderr, flush=True)
    return result


def train_tokens(run: Path, summary: dict) -> int | None:
    if isinstance(summary.get("tokens"), int):
        return summary["tokens"]
    path = run / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    seen = [m["tokens_seen"] for m in lines if m.get("type") == "train" and "tokens_seen" in m]
    return seen[-1] if seen else None


def rate(tokens: int | None, seconds: float | None) -> float | None:
    return round(tokens / seconds, 1) if tokens and seconds else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def transport_throughput(store: Path, work: Path) -> dict:
    """T: publish -> fetch of `store` as one chunk through Mooncake on loopback (see the module); or its error."""
    try:
        from draftsmith.extract.spool.mooncake import MooncakeAddress, MooncakeMaster, MooncakeSpool
    except ImportError as err:
        return {"error": f"Mooncake cannot be imported: {err}"}
    size = tree_bytes(store)
    master = MooncakeMaster(work / "logs" / "mooncake_master.log")
    address = master.start()
    publisher = None
    try:
        publisher = subprocess.Popen(
            [sys.executable, "-c", PUBLISHER, str(store), str(address), str(work / "publisher"), str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(work / "logs" / "T publish.err", "w"),  # noqa: SIM115 - the publisher holds it until it ends
            text=True,
        )
        line = publisher.stdout.readline()
        if not line:
            return {"error": f"the publisher failed: see {work / 'logs' / 'T publish.err'}"}
        publish_s = json.loads(line)["publish_s"]
        reader = MooncakeSpool(MooncakeAddress.parse(str(address))).connect()
        t0 = time.perf_counter()
        local = reader.fetch("bench", work / "fetched")
        fetch_s = time.perf_counter() - t0
        reader.close()
        if local is None or tree_bytes(local) != size:
            return {"error": "the fetched chunk is not the published one"}
        return {
            "bytes": size,
            "publish_s": round(publish_s, 3),
            "fetch_s": round(fetch_s, 3),
            "publish_GBps": round(size / publish_s / 1e9, 3),
            "fetch_GBps": round(size / fetch_s / 1e9, 3),
        }
    finally:
        if publisher is not None:
            with contextlib.suppress(OSError, ValueError):
                publisher.stdin.write("\n")
                publisher.stdin.flush()
            with contextlib.suppress(subprocess.TimeoutExpired):
                publisher.wait(30)
        master.stop()
        shutil.rmtree(work / "fetched", ignore_errors=True)
        shutil.rmtree(work / "publisher", ignore_errors=True)


def machine() -> dict:
    from draftsmith.core import hardware

    cpu = hardware.probe()
    gpu = None
    if shutil.which("nvidia-smi"):
        probe = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], check=False, capture_output=True, text=True
        )
        gpu = probe.stdout.strip().replace("\n", ", ") or None
    return {
        "cpus": os.cpu_count(),
        "cpus_allowed": len(os.sched_getaffinity(0)),
        "cpu_model": cpu.model,
        "cpu_flags": list(cpu.flags),
        "native_bf16": cpu.native_bf16,
        "gpu": gpu,
    }


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def default_spool_gb(prepared: Path, token_budget: int, eval_fraction: float, split_seed: int) -> tuple[float, int]:
    """(GiB, estimated store bytes): a tenth of the bf16 store of the whole prepared set, but at least what the
    trainer accepts: SPOOL_CHUNKS chunks of one optimizer step (at most `token_budget` tokens) each, besides the
    held-out split's chunk (the same split the trainer makes), sized as the spool sizes its chunks; 2 % over that."""
    from draftsmith.core import sizing
    from draftsmith.extract.spool import chunk_bytes
    from draftsmith.prepare.dataset import open_prepared, split_indices

    data = open_prepared(prepared)
    hidden, layer_ids, n = data.manifest.target.hidden_size, 4, len(data)  # 3 aux layers + the last (the default)
    store = sizing.store_bytes(data.manifest.num_tokens, hidden, layer_ids, "bf16", samples=n)
    _, held = split_indices(n, eval_fraction, split_seed)
    step = chunk_bytes(token_budget, token_budget // max(1, int(data.lengths.min())), hidden, layer_ids, "bf16")
    held_out = chunk_bytes(int(data.lengths[held].sum()), len(held), hidden, layer_ids, "bf16") if held else 0
    least = math.ceil((sizing.SPOOL_CHUNKS * step + held_out) * 1.02)
    return math.ceil(max(store / 10, least) / GiB * 1e6) / 1e6, store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=200, help="conversations to prepare (default 200)")
    parser.add_argument("--max-length", type=int, default=None, help="default: the small budget's (512)")
    parser.add_argument(
        "--token-budget", type=int, default=None, help="train micro-batch tokens (default: the small budget's, 1024)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="train --max-steps (default: the small budget's 2 epochs)"
    )
    parser.add_argument(
        "--spool-gb",
        type=float,
        default=None,
        help="B's spool bound in GiB (default: a tenth of the estimated store, at least 4 chunks of one step)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="train --device")
    parser.add_argument(
        "--vllm-compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let vLLM compile the target (default: on GPUs only; minutes of start-up on CPU)",
    )
    parser.add_argument("--prepared", type=Path, help="an existing prepared set (default: prepare ShareGPT now)")
    parser.add_argument("--work", type=Path, help="work directory (default: a temp dir, deleted unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (store, runs, logs)")
    parser.add_argument("--skip-offline", action="store_true", help="run B only (no A numbers, no ratios)")
    parser.add_argument(
        "--mooncake",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run C and T, through Mooncake (default: on)",
    )
    parser.add_argument(
        "--engine-cores",
        default=None,
        help=(
            "CPU only: split the cores as disjoint devices, e.g. 0 on a 2-core machine: A's extract runs on these "
            "cores and A's train on the others; B gets --engine-devices CORES (its trainer keeps the others). "
            "Default: each of A's stages uses every core; B runs as draftsmith does by default (on a CPU its engine "
            "on the first half of the cores, its trainer on the rest)."
        ),
    )
    args = parser.parse_args()

    import torch

    from draftsmith.config import TrainConfig
    from draftsmith.core.manifest import read_manifest
    from draftsmith.extract.store import StoreManifest
    from draftsmith.prepare.dataset import PreparedManifest
    from draftsmith.quickstart import BUDGETS

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    # benchmarks/extract.py: the embedded ShareGPT, prepared for the default target
    from extract import _prepared

    small = BUDGETS["small"]
    max_length = args.max_length or small.max_length
    token_budget = args.token_budget or small.token_budget
    compile_ = torch.cuda.is_available() if args.vllm_compile is None else args.vllm_compile
    env = dict(os.environ, COLUMNS="250")  # the summary table unwrapped, for parse_summary
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("PYTHONUNBUFFERED", "1")

    work = args.work or Path(tempfile.mkdtemp(prefix="draftsmith-online-"))
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    load_before = load()
    t_all = time.perf_counter()
    try:
        prepared = args.prepared or _prepared(work, args.samples, max_length)
        prepare_s = round(time.perf_counter() - t_all, 1)  # not a stage compared here (0 when reused)
        pm = read_manifest(prepared, PreparedManifest)
        defaults = TrainConfig.model_fields
        spool_gb, store_estimate = default_spool_gb(
            prepared, token_budget, defaults["eval_fraction"].default, defaults["split_seed"].default
        )
        spool_gb = args.spool_gb or spool_gb
        compile_flag = ["--vllm-compile" if compile_ else "--no-vllm-compile"]
        train_opts = [
            "--epochs",
            str(small.epochs),
            "--token-budget",
            str(token_budget),
            "--ttt-steps",
            str(small.ttt_steps),
            "--draft-vocab-size",
            str(small.draft_vocab_size),
            "--lr",
            str(small.lr),
            "--warmup-steps",
            "20",
            "--save-every",
            "100",
            "--seed",
            str(args.seed),
            "--device",
            args.device,
            "--no-resume",
        ]
        train_opts += ["--max-steps", str(args.steps)] if args.steps else []

        store, run_a, run_b = work / "store", work / "run-offline", work / "run-online"
        engine_cores = rest_cores = None
        split: list[str] = []
        if args.engine_cores:
            chosen = {int(c) for c in args.engine_cores.split(",")}
            engine_cores = ",".join(map(str, sorted(chosen)))
            rest_cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)) if c not in chosen)
            split = ["--engine-devices", engine_cores]
        a_extract = a_train = None
        if not args.skip_offline:
            extract_env = dict(env, VLLM_CPU_OMP_THREADS_BIND=engine_cores) if engine_cores else env
            a_extract = run_stage(
                "A extract",
                ["extract", "--prepared", str(prepared), "--output", str(store), "--backend", "vllm", *compile_flag],
                extract_env,
                logs,
                watch=store,
                cores=engine_cores,
            )
            if a_extract["rc"] == 0:
                a_train = run_stage(
                    "A train",
                    ["train", "--data", str(store), "--output", str(run_a), *train_opts],
                    env,
                    logs,
                    cores=rest_cores,
                )
        b = run_stage(
            "B online",
            [
                "train",
                "--data",
                str(prepared),
                "--engine",
                "vllm",
                "--spool-gb",
                f"{spool_gb:g}",
                "--spool",
                str(run_b / "spool"),
                "--output",
                str(run_b),
                *compile_flag,
                *split,
                *train_opts,
            ],
            env,
            logs,
            watch=run_b / "spool",
        )
        c = transport = None
        if args.mooncake:
            run_c = work / "run-mooncake"
            c = run_stage(
                "C mooncake",
                [
                    "train",
                    "--data",
                    str(prepared),
                    "--engine",
                    "vllm",
                    "--spool-gb",
                    f"{spool_gb:g}",
                    "--spool",
                    "mooncake",
                    "--output",
                    str(run_c),
                    *compile_flag,
                    *split,
                    *train_opts,
                ],
                env,
                logs,
            )
            if c["rc"] == 0 and c["summary"].get("mode") != MOONCAKE_MODE:
                c["rc"], c["error"] = -1, f"ran in mode {c['summary'].get('mode')!r}, not {MOONCAKE_MODE!r}"
            if a_extract is not None and a_extract["rc"] == 0:
                transport = transport_throughput(store, work)
        load_after = load()
        if b["rc"] == 0 and b["summary"].get("mode") != ONLINE_MODE:
            b["rc"], b["error"] = (
                -1,
                (
                    f"ran in mode {b['summary'].get('mode')!r}, not {ONLINE_MODE!r}: this "
                    "draftsmith does not train from vLLM engines yet"
                ),
            )
            print(f"B online: NOT COUNTED: {b['error']}", file=sys.stderr)

        offline: dict = {}
        if a_extract is not None:
            s = a_extract["summary"]
            offline.update(extract_s=a_extract["wall_s"], extract_error=a_extract.get("error"))
            if a_extract["rc"] == 0:
                sm = read_manifest(store, StoreManifest)
                offline.update(
                    extract_tokens=sm.num_tokens,
                    extract_tokens_per_s_wall=rate(sm.num_tokens, a_extract["wall_s"]),
                    extract_tokens_per_s=s.get("tokens/s"),
                    engine_start_s=s.get("engine start (s)"),
                    extract_backend=s.get("backend"),
                    store_bytes=tree_bytes(store),
                    store_peak_sampled_bytes=a_extract["disk_peak_bytes"],
                )
        if a_train is not None:
            s = a_train["summary"]
            tokens = train_tokens(run_a, s)
            offline.update(
                train_s=a_train["wall_s"],
                train_error=a_train.get("error"),
                train_tokens=tokens,
                train_tokens_per_s_wall=rate(tokens, a_train["wall_s"]),
                train_tokens_per_s=s.get("tokens/s"),
                train_steps=s.get("steps"),
                train_acceptance_length=s.get("final acceptance length (sim.)"),
            )
            if a_train["rc"] == 0:
                offline["end_to_end_tokens_per_s"] = rate(tokens, a_extract["wall_s"] + a_train["wall_s"])
        s = b["summary"]
        b_tokens = train_tokens(run_b, s) if b["rc"] == 0 else None
        online = {
            "wall_s": b["wall_s"],
            "error": b.get("error"),
            "mode": s.get("mode"),
            "tokens": b_tokens,
            "tokens_per_s_wall": rate(b_tokens, b["wall_s"]),
            "tokens_per_s": s.get("tokens/s"),
            "extraction_tokens_per_s": s.get("extraction tokens/s"),
            "steps": s.get("steps"),
            "acceptance_length": s.get("final acceptance length (sim.)"),
            "spool_gb": spool_gb,
            "spool_bound_bytes": s.get("spool bound (bytes)"),
            "spool_peak_bytes": b["disk_peak_bytes"],
            "spool_peak_summary_bytes": s.get("spool peak (bytes)"),
            "spool_final_bytes": b["disk_final_bytes"],
            "spool_samples": b["disk_samples"],
        }
        online["trainer_wait_s"] = s.get("trainer waited (s)")
        mooncake = None
        if c is not None:
            sc = c["summary"]
            c_tokens = train_tokens(run_c, sc) if c["rc"] == 0 else None
            mooncake = {
                "wall_s": c["wall_s"],
                "error": c.get("error"),
                "mode": sc.get("mode"),
                "tokens": c_tokens,
                "tokens_per_s_wall": rate(c_tokens, c["wall_s"]),
                "tokens_per_s": sc.get("tokens/s"),
                "extraction_tokens_per_s": sc.get("extraction tokens/s"),
                "trainer_wait_s": sc.get("trainer waited (s)"),
                "spool_peak_summary_bytes": sc.get("spool peak (bytes)"),
                "acceptance_length": sc.get("final acceptance length (sim.)"),
            }
        ok = b["rc"] == 0 and bool(offline.get("end_to_end_tokens_per_s"))
        stage_rates = [offline.get("extract_tokens_per_s"), offline.get("train_tokens_per_s")]
        wall_rates = [offline.get("extract_tokens_per_s_wall"), offline.get("train_tokens_per_s_wall")]
        result = {
            "target": pm.target.architecture,
            "samples": pm.num_samples,
            "prepared_tokens": pm.num_tokens,
            "max_length": pm.max_length,
            "seed": args.seed,
            "vllm_compile": compile_,
            "cores": (
                {"engine": engine_cores, "trainer": rest_cores}
                if engine_cores
                else "A: every core; B: draftsmith's default"
            ),
            "train_options": " ".join(train_opts),
            "store_estimate_bytes": store_estimate,
            "prepare_s": prepare_s,
            "offline": offline,
            "online": online,
            "ratio_vs_slower_stage": ratio(online["tokens_per_s"], min(stage_rates))
            if ok and all(stage_rates)
            else None,
            "ratio_vs_slower_stage_wall": ratio(online["tokens_per_s_wall"], min(wall_rates))
            if ok and all(wall_rates)
            else None,
            "ratio_vs_end_to_end": ratio(online["tokens_per_s_wall"], offline.get("end_to_end_tokens_per_s"))
            if ok
            else None,
            "disk_ratio": ratio(online["spool_peak_bytes"], offline.get("store_bytes")) if b["rc"] == 0 else None,
            "mooncake": mooncake,
            "transport": transport,
            "mooncake_vs_directory": ratio(mooncake["tokens_per_s"], online["tokens_per_s"])
            if mooncake and mooncake["tokens"] and b["rc"] == 0
            else None,
            "goals": {"ratio_vs_slower_stage": ">= 0.8", "disk_ratio": "<= 0.10"},
            "machine": machine(),
            "load_before": load_before,
            "load_after": load_after,
            "total_s": round(time.perf_counter() - t_all, 1),
            "work": str(work) if args.keep or args.work else None,
        }
    finally:
        if not (args.keep or args.work):
            shutil.rmtree(work, ignore_errors=True)
    _print_table(result)
    print(json.dumps(result))


def _print_table(r: dict) -> None:
    a, b = r["offline"], r["online"]

    def num(x, unit=""):
        if x is None:
            return "-"
        return f"{x:,.1f}{unit}" if isinstance(x, float) else f"{x:,}{unit}"

    def mb(x):
        return "-" if x is None else f"{x / 2**20:,.1f} MiB"

    m = r["machine"]
    print(
        f"\n{r['target']}: {r['samples']} samples, {r['prepared_tokens']:,} tokens (max length {r['max_length']}), "
        f"seed {r['seed']}, vLLM compile {r['vllm_compile']}\ntrain options: {r['train_options']}\n"
        f"machine: {m['cpus']} CPUs ({m['cpus_allowed']} allowed) {m['cpu_model']}, GPU {m['gpu']}; "
        f"load {r['load_before']} -> {r['load_after']}",
        file=sys.stderr,
    )
    rows = [
        (
            "A extract",
            a.get("extract_s"),
            a.get("extract_tokens"),
            a.get("extract_tokens_per_s_wall"),
            a.get("extract_tokens_per_s"),
            a.get("extract_error"),
        ),
        (
            "A train",
            a.get("train_s"),
            a.get("train_tokens"),
            a.get("train_tokens_per_s_wall"),
            a.get("train_tokens_per_s"),
            a.get("train_error"),
        ),
        (
            "A end to end",
            (a.get("extract_s") or 0) + (a.get("train_s") or 0) or None,
            a.get("train_tokens"),
            a.get("end_to_end_tokens_per_s"),
            None,
            None,
        ),
        ("B online", b["wall_s"], b["tokens"], b["tokens_per_s_wall"], b["tokens_per_s"], b["error"]),
    ]
    print(f"{'':<13} {'wall s':>8} {'tokens':>10} {'tok/s wall':>11} {'tok/s stage':>12}", file=sys.stderr)
    for name, secs, tokens, wall, stage, error in rows:
        line = f"{name:<13} {num(secs):>8} {num(tokens):>10} {num(wall):>11} {num(stage):>12}"
        print(line + (f"   FAILED: {error}" if error else ""), file=sys.stderr)
    print(f"B extraction tokens/s (summary): {num(b['extraction_tokens_per_s'])}", file=sys.stderr)
    print(
        f"disk: store {mb(a.get('store_bytes'))} (estimated {mb(r['store_estimate_bytes'])}); spool bound "
        f"{r['online']['spool_gb']:g} GiB (summary: {mb(b['spool_bound_bytes'])}), peak measured "
        f"{mb(b['spool_peak_bytes'])} over {b['spool_samples']} samples "
        f"(summary: {mb(b['spool_peak_summary_bytes'])})",
        file=sys.stderr,
    )
    c, t = r.get("mooncake"), r.get("transport")
    if c is not None:
        print(
            f"C mooncake: {num(c['wall_s'])} s wall, {num(c['tokens_per_s'])} tok/s (B: {num(b['tokens_per_s'])}), "
            f"trainer waited {c['trainer_wait_s']} s (B: {b['trainer_wait_s']} s); C / B tokens/s: "
            f"{r['mooncake_vs_directory']}" + (f"   FAILED: {c['error']}" if c["error"] else ""),
            file=sys.stderr,
        )
    if t is not None:
        print(f"T transport: {t}", file=sys.stderr)
    print(
        f"ratio B / slower A stage: {r['ratio_vs_slower_stage']} (wall rates: {r['ratio_vs_slower_stage_wall']}; "
        f"goal >= 0.8); B / A end to end: {r['ratio_vs_end_to_end']}; disk B / store: {r['disk_ratio']} "
        "(goal <= 0.10)",
        file=sys.stderr,
    )
    if r["work"]:
        print(f"work directory kept: {r['work']}", file=sys.stderr)


if __name__ == "__main__":
    from draftsmith.core.errors import DraftsmithError

    try:
        main()
    except DraftsmithError as err:  # bad input (--prepared, --spool-gb ...): one line
        sys.exit(f"error: {err}")
