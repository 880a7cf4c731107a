"""What a HARTS plan means: sealing, decoding, the fast slice check, the oracle validator, the memory
model and the window exports (docs/design/plan-contract.md).

Both sides import it (`planner_service` builds and validates plans with it, `trainer` checks and
decodes the slices it runs); it imports only `proto` (the wire), numpy and numba, never torch,
FastAPI or gRPC. Modules: `seal`, `microbatch`, `decode`, `header`, `phases`, `slice_check` with
`slice_kernels`, `validator` with the `oracle_*` modules, `memory_model`, `cluster_memory` with
`named_models`, `window_exports`, `cross_edges`.
"""
