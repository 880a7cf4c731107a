"""What a HARTS plan means: sealing, decoding, the fast slice check, the oracle validator, the memory
model and the window exports (docs/design/plan-contract.md).

Both sides import it (`planner_service` builds and validates plans with it, `trainer` checks and
decodes the slices it runs); it imports only `proto` (the wire), numpy and numba, never torch,
FastAPI or gRPC. Modules: `seal` (deterministic bytes + SHA-256), `microbatch` (a microbatch's
bounds-checked arrays), `decode` (a rank's slice decoded once), `header` (the step-wide header
rules), `phases` (lock-step phases, stand-ins, costs), `slice_check` with `slice_kernels` (the fast
check a trainer runs), `validator` with `oracle_rows`, `oracle_schedule`, `oracle_stats` and
`oracle_logprobs` (the independent oracle), `memory_model` (bytes of live activations),
`cluster_memory` and `named_models` (a model's memory per rank on a cluster), `window_exports`
(what an exporter keeps), `cross_edges` (windows across ranks).
"""
