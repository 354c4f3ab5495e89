"""``appliance tune MODEL``: find a faster config for one model on this device.

    appliance tune classifier --max-batch-sizes 8,16,32 --queue-delays-us 0,2000 \\
        --max-instances 3 --p99-ms 30 --output classifier.yaml

The live server does the work (Model Analyzer's role, on the device itself): each
candidate config is hot-swapped in through the repository load API (``config``
override), measured with ``appliance perf``, and the model's measured memory is
read from its statistics. The search is pruned, not exhaustive: instance counts
grow only while throughput rises (by 5 %) and stop when the server refuses a copy
(memory budget) or ``--memory-budget`` is exceeded; a larger max batch size is
not tried once a smaller one was no faster at one instance. With several ONNX
Runtime instances both ways of sharing the cores are tried: one pool of every core
that whichever instances are busy draw on (the server's default) and a fixed
``cores / N`` each (``intra_op_thread_count``; the cores are this machine's). At the end the
config that served before is loaded again, unless ``--apply`` loads the winner.
The winner is written as YAML, or as ``config.pbtxt`` text for a Triton
repository (``--output *.pbtxt``).
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson
import yaml

from appliance.cli_commands import PREFERRED
from appliance.config.fields import parse_limit
from appliance.config.triton_config import dict_to_pbtxt
from appliance.core.instances import cpu_share
from appliance.errors import ApplianceError, invalid
from appliance.perf.command import Settings, new_loop, run
from appliance.perf.httpclient import Admin, model_path
from appliance.perf.runner import Point, parse_range

GROWTH = 1.05  # another instance must add 5 % throughput to be worth its memory


@dataclass
class Trial:
    """One measured (or refused) config."""

    label: str
    config: dict[str, Any]
    status: str = "ok"  # ok | refused | over-budget | failed | errors | no requests
    reason: str = ""
    memory_bytes: int = 0
    point: Point | None = None
    feasible: bool = False

    @property
    def throughput(self) -> float:
        return self.point.throughput_infer_s if self.point else 0.0


@dataclass
class Options:
    model: str
    url: str = "127.0.0.1:8000"
    token: str = ""
    backends: tuple[str, ...] = ()
    max_batch_sizes: tuple[int, ...] = ()
    queue_delays_us: tuple[int, ...] = ()
    preferred: tuple[str, ...] = ("max",)
    max_instances: int = 2
    memory_budget: int | None = None
    p99_ms: float | None = None
    min_throughput: float | None = None
    concurrency: int = 8
    batch_size: int = 1
    warmup_s: float = 1.0
    window_s: float = 3.0
    transport: str = "http"
    min_requests: int = 0  # each trial's window lasts until that many requests completed


def candidate(
    base: dict[str, Any],
    backend: str,
    mbs: int,
    preferred: str,
    delay: int,
    n: int,
    split: int = 0,
) -> tuple[str, dict[str, Any]]:
    """The model's running config with the searched fields set; ``split``: that many
    intra-op threads per instance (else the server's rule: one shared pool)."""
    cfg = copy.deepcopy(base)
    if backend != cfg.get("backend"):
        cfg["backend"] = backend
        cfg.pop("platform", None)  # a platform names the old backend's model format
    if int(base.get("max_batch_size", 0)) > 0:
        cfg["max_batch_size"] = mbs
        sizes = {"none": [], "max": [mbs], "pow2": [2**k for k in range(mbs.bit_length())]}
        db = cfg.setdefault("dynamic_batching", {})
        db["preferred_batch_size"] = [s for s in sizes[preferred] if 1 < s <= mbs]
        db["max_queue_delay_microseconds"] = delay
    groups = cfg.get("instance_group") or [{"kind": "KIND_CPU"}]
    cfg["instance_group"] = [{**{k: v for k, v in groups[0].items() if k != "name"}, "count": n}]
    if split:
        # Triton's JSON form of a parameter, as the load API parses the config
        threads = {"string_value": str(split)}
        cfg["parameters"] = {**(cfg.get("parameters") or {}), "intra_op_thread_count": threads}
    label = f"{backend} n={n}" + (f" threads={split} each" if split else "")
    if int(base.get("max_batch_size", 0)) > 0:
        label += f" mbs={mbs} pref={preferred} delay={delay}us"
    return label, cfg


def split_threads(backend: str, n: int, base: dict[str, Any]) -> int:
    """Intra-op threads per instance for the "fixed slice each" trial of ``n`` ONNX
    Runtime instances (0: nothing to try: one instance, another engine, or a config
    that pins the threads itself)."""
    params = base.get("parameters") or {}
    if n < 2 or backend != "onnxruntime" or "intra_op_thread_count" in params:
        return 0
    return cpu_share(n)


def _memory(stats: dict[str, Any] | None) -> int:
    return sum(int(r.get("byte_size", 0)) for r in (stats or {}).get("memory_usage") or [])


class Tuner:
    def __init__(self, opts: Options, out: Any = sys.stderr) -> None:
        self.o, self.out = opts, out
        self.admin = Admin(opts.url, opts.token)
        self._load_path = f"/v2/repository/models/{quote(opts.model, safe='')}/load"
        self.trials: list[Trial] = []

    def _feasible(self, t: Trial) -> bool:
        p = t.point
        if t.status != "ok" or p is None or not p.requests:
            return False
        if self.o.p99_ms is not None and p.p99_ms > self.o.p99_ms:
            return False
        return self.o.min_throughput is None or p.throughput_infer_s >= self.o.min_throughput

    async def _measure(self, t: Trial) -> Trial:
        stats = await self.admin.stats(self.o.model)
        t.memory_bytes = _memory(stats)
        if self.o.memory_budget is not None and t.memory_bytes > self.o.memory_budget:
            t.status, t.reason = "over-budget", f"{t.memory_bytes} bytes"
        else:
            s = Settings(
                self.o.model, self.o.url, self.o.transport, batch_size=self.o.batch_size,
                concurrency=[self.o.concurrency], warmup_s=self.o.warmup_s,
                window_s=self.o.window_s, token=self.o.token, min_requests=self.o.min_requests,
            )  # fmt: skip
            t.point = (await run(s))[0]
            if t.point.errors:
                t.status = "errors"
                t.reason = next(iter(t.point.errors_by_kind), "")
            elif not t.point.requests:  # nothing was measured: no figure to rank it by
                t.status = "no requests"
                t.reason = f"no request completed in its {t.point.window_s:.1f} s window"
        t.feasible = self._feasible(t)
        self._show(t)
        self.trials.append(t)
        return t

    def _show(self, t: Trial) -> None:
        p = t.point
        figures = f"{p.throughput_infer_s:9.1f} infer/s p99 {p.p99_ms:7.2f} ms" if p else ""
        mem = f"{t.memory_bytes / 2**20:7.1f} MiB"
        self.out.write(f"  {t.label:<48} {mem} {figures} {t.status} {t.reason[:60]}\n")
        self.out.flush()

    async def _try(self, label: str, cfg: dict[str, Any]) -> Trial:
        body = {"parameters": {"config": orjson.dumps(cfg).decode()}}
        try:
            await self.admin.post(self._load_path, body)
        except ApplianceError as exc:
            return self._refused(Trial(label, cfg, "refused", exc.message))
        # the appliance loads as many instances as its memory budget admits (a warning,
        # not a failure) and reports the admitted count in the model's config
        wanted = sum(int(g.get("count", 1)) for g in cfg["instance_group"])
        running = await self.admin.get_json(model_path(self.o.model) + "/config")
        admitted = sum(int(g.get("count", 1)) for g in running.get("instance_group") or [])
        if admitted < wanted:
            reason = f"the memory budget admitted {admitted} of {wanted} instances"
            return self._refused(Trial(label, cfg, "refused", reason))
        return await self._measure(Trial(label, cfg))

    def _refused(self, t: Trial) -> Trial:
        self._show(t)
        self.trials.append(t)
        return t

    async def search(self) -> Trial:
        base = await self.admin.get_json(model_path(self.o.model) + "/config")
        batched = int(base.get("max_batch_size", 0)) > 0
        db = base.get("dynamic_batching") or {}
        backend0 = str(base.get("backend") or "")
        mbs0 = int(base.get("max_batch_size", 0))
        delay0 = int(db.get("max_queue_delay_microseconds", 0))
        self.out.write(f"tuning '{self.o.model}' at concurrency {self.o.concurrency}\n")
        default = await self._measure(Trial("running config (default)", base))
        try:
            for backend in self.o.backends or (backend0,):
                for delay in (self.o.queue_delays_us or (delay0,)) if batched else (0,):
                    for preferred in self.o.preferred if batched else ("none",):
                        await self._grow_batch(base, backend, delay, preferred, mbs0, batched)
        finally:
            self.out.write("restoring the config that served before\n")
            await self._restore(base)
        return self.best() or default

    async def _grow_batch(
        self, base: dict[str, Any], backend: str, delay: int, pref: str, mbs0: int, batched: bool
    ) -> None:
        best_at_one = 0.0
        for mbs in sorted(self.o.max_batch_sizes or (mbs0,)) if batched else (0,):
            first = await self._grow_instances(base, backend, mbs, pref, delay)
            if first is not None and first.throughput <= best_at_one:
                return  # bigger batches did not help at one instance: stop growing them
            best_at_one = max(best_at_one, first.throughput if first else 0.0)

    async def _grow_instances(
        self, base: dict[str, Any], backend: str, mbs: int, pref: str, delay: int
    ) -> Trial | None:
        first, last = None, 0.0
        for n in range(1, self.o.max_instances + 1):
            t = await self._try(*candidate(base, backend, mbs, pref, delay, n))
            if t.status in ("refused", "over-budget", "failed"):
                return first  # out of memory (or the backend cannot run it): stop growing
            first = first or t
            best = t.throughput
            split = split_threads(backend, n, base)
            if split:  # the other way to share the cores: a fixed slice each
                s = await self._try(*candidate(base, backend, mbs, pref, delay, n, split))
                best = max(best, s.throughput)
            if n > 1 and best < last * GROWTH:
                break  # throughput stopped rising
            last = best
        return first

    async def _restore(self, base: dict[str, Any]) -> None:
        body = {"parameters": {"config": orjson.dumps(base).decode()}}
        await self.admin.post(self._load_path, body)

    def ranked(self) -> list[Trial]:
        measured = [t for t in self.trials if t.point is not None]
        return sorted(measured, key=lambda t: (not t.feasible, -t.throughput, t.memory_bytes))

    def best(self) -> Trial | None:
        ranked = self.ranked()
        return ranked[0] if ranked and ranked[0].feasible else None

    async def apply(self, t: Trial) -> None:
        await self._restore(t.config)

    async def close(self) -> None:
        await self.admin.close()


def render(cfg: dict[str, Any], fmt: str, comment: str) -> str:
    """The config as the repository's file: YAML or Triton's protobuf text."""
    if fmt == "pbtxt":  # protobuf and Triton's schema only: no grpcio needed
        return f"# {comment}\n" + dict_to_pbtxt(cfg, ignore_unknown=True)
    return f"# {comment}\n" + yaml.safe_dump(cfg, sort_keys=False)


def _ints(text: str, what: str) -> tuple[int, ...]:
    return tuple(int(v) for v in parse_range(text, what)) if text else ()


def options_from_args(a: argparse.Namespace) -> Options:
    preferred = tuple(v.strip() for v in a.preferred.split(",") if v.strip())
    if not preferred or any(v not in PREFERRED for v in preferred):
        raise invalid(f"--preferred {a.preferred!r}: choose from {', '.join(PREFERRED)}")
    if a.max_instances < 1 or a.concurrency < 1 or a.duration <= 0 or a.batch_size < 1:
        raise invalid("--max-instances, --concurrency, -b and --duration must be > 0")
    if a.measurement_request_count < 0:
        raise invalid("--measurement-request-count must be >= 0")
    delays = tuple(int(v) for v in a.queue_delays_us.split(",") if v.strip())
    if any(d < 0 for d in delays):
        raise invalid("--queue-delays-us: delays must be >= 0")
    return Options(
        model=a.model, url=a.url, token=a.token,
        backends=tuple(b.strip() for b in a.backends.split(",") if b.strip()),
        max_batch_sizes=_ints(a.max_batch_sizes, "--max-batch-sizes"),
        queue_delays_us=delays, preferred=preferred, max_instances=a.max_instances,
        memory_budget=parse_limit(a.memory_budget, "--memory-budget", "memory_budget"),
        p99_ms=a.p99_ms, min_throughput=a.min_throughput, concurrency=a.concurrency,
        batch_size=a.batch_size, warmup_s=a.warmup, window_s=a.duration, transport=a.transport,
        min_requests=a.measurement_request_count,
    )  # fmt: skip


async def tune(opts: Options, output: Path | None, apply: bool) -> tuple[Tuner, Trial]:
    tuner = Tuner(opts)
    try:
        winner = await tuner.search()
        if apply:
            await tuner.apply(winner)
        if output is not None:
            fmt = "pbtxt" if output.suffix == ".pbtxt" else "yaml"
            p = winner.point
            note = f"written by appliance tune: {winner.label}"
            if p is not None:
                note += f", {p.throughput_infer_s:.1f} infer/s, p99 {p.p99_ms:.2f} ms"
            output.write_text(render(winner.config, fmt, note))
        return tuner, winner
    finally:
        await tuner.close()


def main(args: argparse.Namespace) -> int:
    try:
        opts = options_from_args(args)
    except ApplianceError as exc:
        print(f"appliance tune: error: {exc}", file=sys.stderr)
        return 2
    loop = new_loop()
    try:
        tuner, winner = loop.run_until_complete(tune(opts, args.output, args.apply))
    except ApplianceError as exc:
        print(f"appliance tune: error: {exc}", file=sys.stderr)
        return 2
    finally:
        loop.close()
    print("\nranked (feasible first, then throughput, then memory):")
    for i, t in enumerate(tuner.ranked(), 1):
        p = t.point
        assert p is not None
        mark = "" if t.feasible else "  (misses the objective)"
        print(
            f"{i:3}. {t.label:<48} {p.throughput_infer_s:9.1f} infer/s  p99 {p.p99_ms:7.2f} ms"
            f"  {t.memory_bytes / 2**20:7.1f} MiB{mark}"
        )
    print(f"winner: {winner.label}" + (" (applied)" if args.apply else ""))
    if args.json:
        rows = [
            {"label": t.label, "status": t.status, "reason": t.reason, "feasible": t.feasible,
             "memory_bytes": t.memory_bytes, "config": t.config,
             "point": t.point.__dict__ if t.point else None}
            for t in tuner.trials
        ]  # fmt: skip
        args.json.write_bytes(orjson.dumps({"winner": winner.label, "trials": rows}))
    return 0 if winner.feasible else 1
