"""python -m gpupool.admission_queue: the admission-queue service."""

from __future__ import annotations

import argparse
import asyncio

from gpupool.admission_queue.service import AdmissionQueue
from gpupool.observability.service_metrics import metrics_projection, queue_registry
from gpupool.runtime.service import add_common_arguments, common_options, run_service, serve


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m gpupool.admission_queue", description=__doc__)
    add_common_arguments(parser, default_port=9102)
    args = parser.parse_args()
    service = AdmissionQueue()

    async def run(stop: asyncio.Event) -> None:
        await run_service(
            service,
            common_options(args),
            stop,
            registry_factory=queue_registry,
            projection_factory=metrics_projection,
        )

    serve(run, log_level=args.log_level)


if __name__ == "__main__":
    main()
