"""A load run against ``python -m domino_jax.serve``: throughput and tau under concurrent
clients, AR against the default method.

    python benchmarks/bench_serve.py                                 # SmolLM2 demo pair, CPU
    python benchmarks/bench_serve.py --clients 8 32 --requests 3 --max-tokens 64

For each method (``ar``: ``--method ar``; ``default``: the CLI's default, Domino with
adaptive widths and lookup arms) and each client count C, one server process with
``--slots C`` is started (it compiles before reporting healthy; not timed), warmed with one
request, then C client threads (the ``openai`` client, chat completions, T = 0) each send
``--requests`` requests one after another (a closed loop: C requests live at a time). Per
run: the output tokens over the wall time of the load (``tokens_per_second``, client side),
the mean tokens committed per round (``tau``: the server's ``/metrics`` counters
``domino_committed_tokens_total / domino_row_rounds_total`` over the load), the adaptive arms
chosen, the mean request latency, the server's busy-time throughput, and whether every
greedy output equals AR's. The server then gets SIGTERM and must exit with status 0.
Writes JSON and Markdown to ``--out`` (``benchmarks/results/serve_load_<date>_<time>``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as _dt
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))

from bench_demo_prompts import PROMPTS  # noqa: E402
from serve_helpers import ServerProcess  # noqa: E402

METHODS = {"ar": ["--method", "ar"], "default": []}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[8, 32])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--requests", type=int, default=3, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--server-args", default="", help="more flags for every server "
                   "(e.g. '--target DIR --draft DIR')")
    p.add_argument("--out", default=None, help="output path without extension")
    return p.parse_args(argv)


def _metrics(url: str) -> dict:
    from serve_helpers import get
    out = {}
    for line in get(url + "/metrics")[1].decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _delta(after: dict, before: dict, prefix: str) -> dict:
    """``{label value: after - before}`` of the series ``prefix{label="value"}`` that grew."""
    return {k[len(prefix):].split('"')[1]: after[k] - before.get(k, 0.0) for k in after
            if k.startswith(prefix + "{") and after[k] - before.get(k, 0.0) > 0}


def run_one(method: str, clients: int, args) -> dict:
    import openai

    extra = METHODS[method] + args.server_args.split()
    log = f"/tmp/bench_serve_{method}_{clients}.log"
    server = ServerProcess(["--slots", str(clients), "--max-prompt-tokens", "64",
                            "--max-new-tokens", str(args.max_tokens)] + extra, log)
    t0 = time.time()
    server.start(timeout=1800)
    startup = time.time() - t0
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=600)
    jobs = [PROMPTS[(c * args.requests + i) % len(PROMPTS)]
            for c in range(clients) for i in range(args.requests)]

    model = client.models.list().data[0].id

    def ask(prompt):
        t = time.perf_counter()
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}],
            max_tokens=args.max_tokens, temperature=0,
            extra_body={"return_token_ids": True})
        return out.choices[0].model_extra["token_ids"], time.perf_counter() - t

    try:
        ask(PROMPTS[0])                                            # warm: first real call
        before = _metrics(server.url)
        t1 = time.perf_counter()

        def client_loop(c):
            return [ask(p) for p in jobs[c * args.requests:(c + 1) * args.requests]]
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            results = [r for rs in pool.map(client_loop, range(clients)) for r in rs]
        wall = time.perf_counter() - t1
        after = _metrics(server.url)
    finally:
        status = server.terminate(timeout=300)
        server.stop()
    tokens = [r[0] for r in results]
    committed = after["domino_committed_tokens_total"] - before[
        "domino_committed_tokens_total"]
    rounds = after["domino_row_rounds_total"] - before["domino_row_rounds_total"]
    busy = (after["domino_prefill_seconds_total"] - before["domino_prefill_seconds_total"]
            + after["domino_decode_seconds_total"] - before["domino_decode_seconds_total"])
    new = sum(len(t) for t in tokens)
    return dict(method=method, clients=clients, slots=clients, requests=len(jobs),
                new_tokens=new, wall_seconds=round(wall, 3),
                tokens_per_second=round(new / wall, 2),
                busy_tokens_per_second=round(new / max(busy, 1e-9), 2),
                tau=round(committed / max(rounds, 1), 4),
                mean_latency_seconds=round(sum(r[1] for r in results) / len(results), 3),
                arm_rounds=_delta(after, before, "domino_adaptive_arm_rounds_total"),
                startup_seconds=round(startup, 1), exit_status=status,
                outputs=tokens)          # in job order: the same prompts in every run


def main(argv=None):
    args = parse_args(argv)
    stamp = _dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    out = args.out or os.path.join(HERE, "results", f"serve_load_{stamp}")
    runs = []
    for clients in args.clients:
        for method in args.methods:
            run = run_one(method, clients, args)
            print(json.dumps({k: v for k, v in run.items() if k != "outputs"}), flush=True)
            runs.append(run)
    for run in runs:                               # greedy: every method gives AR's tokens
        ar = next((r for r in runs if r["method"] == "ar" and r["clients"] == run["clients"]),
                  None)
        run["identical_to_ar"] = None if ar is None else run["outputs"] == ar["outputs"]
        if ar is not None:
            run["speedup_over_ar"] = round(run["tokens_per_second"]
                                           / ar["tokens_per_second"], 3)
    from bench_util import git_commit, versions
    record = dict(date=stamp, commit=git_commit(None), versions=versions(),
                  command="python benchmarks/bench_serve.py " + " ".join(sys.argv[1:]),
                  load_average=os.getloadavg(), cpus=os.cpu_count(),
                  max_tokens=args.max_tokens, requests_per_client=args.requests,
                  runs=[{k: v for k, v in r.items() if k != "outputs"} for r in runs])
    with open(out + ".json", "w") as f:
        json.dump(record, f, indent=2)
    lines = [f"# Server load run {stamp}", "", f"`{record['command']}` at commit "
             f"`{record['commit']}`; {record['cpus']} CPUs, load average at the end "
             f"{', '.join(f'{x:.1f}' for x in record['load_average'])}; chat completions, "
             f"T = 0, max_tokens {args.max_tokens}, {args.requests} requests per client "
             "(closed loop), slots = clients.", "",
             "| clients | method | tokens | wall s | tok/s | speedup | tau | mean latency s "
             "| arms | = AR |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        arms = " ".join(f"{a}:{int(n)}" for a, n in sorted(r["arm_rounds"].items())) or "-"
        lines.append(f"| {r['clients']} | {r['method']} | {r['new_tokens']} | "
                     f"{r['wall_seconds']:.1f} | {r['tokens_per_second']:.1f} | "
                     f"{r.get('speedup_over_ar', 1.0):.2f}x | {r['tau']:.2f} | "
                     f"{r['mean_latency_seconds']:.2f} | {arms} | {r['identical_to_ar']} |")
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {out}.json and {out}.md")


if __name__ == "__main__":
    main()
