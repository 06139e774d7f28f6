"""The same agent jobs on SmolLM2-135M with and without the protocol grammar (the figures of
docs/performance.md, "Grammar-constrained protocol").

    .venv/bin/python -m tests.model.compare [--jobs N] [--agents smol,smol_plain] [--seed S]
                                            [--json FILE]

Prepares the runtime (scripts/model_runtime.py), starts llama.cpp's server, runs the jobs of
tests/model/agents.py in this process on a private Redis, and prints one summary per agent.
CI runs the grammar half as tests/model/test_smollm2.py; this runs both, for the comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from cortex_worker import handles as runtime
from cortex_worker.actions import dispatch
from cortex_worker.testing import StubBroker
from tests.model import agents as smol
from tests.model.runtime import LlamaServer, engine, prepare


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=len(smol.TASKS))
    parser.add_argument("--agents", default="smol,smol_plain")
    parser.add_argument("--seed", type=int, default=smol.SEED,
                        help="the sampling seed every request carries (model.seed)")
    parser.add_argument("--json", type=Path, help="also write every job's report here")
    args = parser.parse_args()
    tasks = [smol.TASKS[i % len(smol.TASKS)] for i in range(args.jobs)]
    setup = time.monotonic()
    model_runtime = prepare()
    work = Path(tempfile.mkdtemp(prefix="cortex-compare-"))
    results: dict[str, object] = {"setup_s": round(time.monotonic() - setup, 1),
                                  "runtime": model_runtime.info}
    with LlamaServer(model_runtime, log_dir=work, seed=args.seed) as server, \
            engine(smol.write_manifests(work / "manifests", args.seed),
                   {"CORTEX_SMOLLM_URL": server.url}):
        results["server_start_s"] = round(server.start_s, 1)
        for agent in args.agents.split(","):
            store = runtime.get_store()
            store.redis.flushdb()
            broker = StubBroker()
            with dispatch.use_broker(broker):
                reports = []
                for task in tasks:
                    report = smol.run_job(store, broker, agent, task)
                    reports.append(report)
                    print(f"{agent}: {report.status:9} {report.seconds:6.1f}s turns={report.turns} "
                          f"errors={report.protocol_errors} invalid={report.invalid_actions} "
                          f"actions={[(a['name'], a['parameters']) for a in report.actions]}",
                          file=sys.stderr, flush=True)
            results[agent] = {"summary": smol.summary(reports),
                              "jobs": [asdict(r) for r in reports]}
            print(json.dumps({agent: smol.summary(reports)}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
