"""Child process for test_crash: consolidate one bank slowly, until the test kills it."""

from __future__ import annotations

import asyncio
import sys

from raylane.actors.consolidation import ConsolidationConfig, Consolidator, MemoryStore

from tests.support.fake_llm import FakeLLM


async def main(dsn: str, bank_id: str) -> None:
    store = await MemoryStore.connect(dsn)
    config = ConsolidationConfig(batch_size=6, llm_batch_size=2, max_parallel_groups=2)
    await Consolidator(store, FakeLLM(latency=0.03), config).run(bank_id)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
