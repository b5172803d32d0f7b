"""Test hook for test_multinode (mounted read-only, put on PYTHONPATH): with
GPUFEED_TEST_LAST_RANK_LATE=SECONDS, the last rank of a torchrun job reaches the end of its
script that much later than the others and then makes one more request to the job's store (a
compare-and-set, as a final barrier or the rendezvous does), before it tears down its process
group. A slow node, a long final checkpoint or a busy machine do the same: the other ranks have
left by then, and the store must still answer. Only trainers (RANK set) are touched."""

import os
import time

_DELAY = float(os.environ.get("GPUFEED_TEST_LAST_RANK_LATE", "0"))

if _DELAY and "RANK" in os.environ:
    import torch.distributed as dist

    _destroy = dist.destroy_process_group

    def _late_destroy(*args, **kwargs):
        if dist.get_rank() == dist.get_world_size() - 1:
            time.sleep(_DELAY)
            store = dist.distributed_c10d._get_default_store()
            store.compare_set("gpufeed-test/late-rank", "", "done")
            print(f"late rank {dist.get_rank()}: the store answered {_DELAY:g} s after", flush=True)
        return _destroy(*args, **kwargs)

    dist.destroy_process_group = _late_destroy
