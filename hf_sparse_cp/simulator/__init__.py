"""The cluster simulator: what a sparse ring step costs on hardware we do not have.

* `traffic.py`: work and bytes of a ring plan, from the same `RingPlan` transfers the ring executes;
* `simulate.py`: workloads and the CP configurations compared;
* `step_model.py`: model presets, hardware, and the predicted step time.

Nothing on the training path imports it; `hf-sparse-cp simulate` and the benchmarks do.
"""
