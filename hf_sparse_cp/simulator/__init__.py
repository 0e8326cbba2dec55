"""Predictions on paper: what a sparse ring step costs, and what memory it holds, on hardware we do not have.

* `shapes.py`: the decoder shapes and presets both predictions take (a leaf);
* `traffic.py`: work and bytes of a ring plan, from the same `RingPlan` transfers the ring executes;
* `simulate.py`: the CP configurations compared; `workloads.py`: the synthetic rows they run on;
* `kept_curve.py`: the share of the blocks the default pattern keeps at a length, from a measured curve
  (both predictions read it; answers outside the measured lengths labelled extrapolated);
* `step_model.py`: hardware and the predicted step time, `head_parallel.py` the same under head parallelism;
  `simulate_cli.py`: `hf-sparse-cp simulate`; `arguments.py`: the flags both commands share;
* `memory_model/`: the bytes a step holds, term by term, and how long a sequence fits;
  `lora.py`: LoRA fine-tuning as it counts it; `memory_cli.py`: `hf-sparse-cp memory`; `memory_table.py`:
  docs/memory.md's predictions, from the command's code.

Nothing on the training path imports it; the command line and the benchmarks do.
"""
