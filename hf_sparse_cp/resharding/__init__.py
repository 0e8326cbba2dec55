"""Sharded state moved between layouts: a run saved on one set of ranks resumes on another.

* `boxes.py`: which slice (`Box`) of each tensor every rank holds under a layout (`Shard(d)` and
  `Replicate()` over a device mesh), and the transfers from one set of boxes to another;
* `checkpoint.py`: `save_sharded_state` / `load_sharded_state`, each rank reading exactly the saved
  slices its new boxes intersect;
* `resume.py`: the Trainer's FSDP2 save and resume through that checkpoint, whatever the new world size.
"""
