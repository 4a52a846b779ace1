"""python -m gpupool.preemption: the preemption service."""

from __future__ import annotations

import argparse
import asyncio

from gpupool.preemption.service import PreemptionService
from gpupool.runtime.service import add_common_arguments, common_options, run_service, serve


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m gpupool.preemption", description=__doc__)
    add_common_arguments(parser, default_port=9103)
    args = parser.parse_args()
    service = PreemptionService()

    async def run(stop: asyncio.Event) -> None:
        await run_service(service, common_options(args), stop)

    serve(run, log_level=args.log_level)


if __name__ == "__main__":
    main()
