"""NxD's rank layout on 4 ranks (gloo), for tests/test_nxd_layers.py: TP=2 (DP=2), then
TP=2 x PP=2, then a world that does not divide. Rank 0 prints one ``LAYOUT`` JSON line per
configuration with every rank's getters (gathered), and ``ERROR`` lines."""
import json
from datetime import timedelta

import torch.distributed as dist

from kiln.neuronx_distributed.parallel_layers import parallel_state as ps


def snapshot():
    me = {"rank": dist.get_rank(), "tp": [ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_size()],
          "dp": [ps.get_data_parallel_rank(), ps.get_data_parallel_size()],
          "pp": [ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_size()],
          "tp_src": ps.get_tensor_model_parallel_src_rank(), "dp_src": ps.get_data_parallel_src_rank(),
          "next": ps.get_pipeline_model_parallel_next_rank(), "prev": ps.get_pipeline_model_parallel_prev_rank(),
          "tp_group_ranks": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
          "dp_group_ranks": dist.get_process_group_ranks(ps.get_data_parallel_group()),
          "pp_group_ranks": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
          "rmsg": ps.rmsg("x")}
    meshes = {"tp": ps.get_tensor_model_parallel_group(as_list=True), "dp": ps.get_data_parallel_group(as_list=True),
              "pp": ps.get_pipeline_model_parallel_group(as_list=True),
              "zero1": ps.get_zero1_sharding_groups()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, me)
    return {"meshes": meshes, "ranks": every}


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out = {}
    for name, kw in (("tp2", dict(tensor_model_parallel_size=2)),
                     ("tp2pp2", dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))):
        ps.initialize_model_parallel(**kw)
        out[name] = snapshot()
        try:
            ps.initialize_model_parallel(**kw)
        except AssertionError as e:
            out[name]["again"] = str(e)
        ps.destroy_model_parallel()
    for name, kw in (("tp3", dict(tensor_model_parallel_size=3)), ("tp0", dict(tensor_model_parallel_size=0)),
                     ("pp0", dict(pipeline_model_parallel_size=0))):
        try:
            ps.initialize_model_parallel(**kw)
            out[name] = "initialized"
        except (RuntimeError, ValueError, ZeroDivisionError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    if dist.get_rank() == 0:
        print("LAYOUT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
