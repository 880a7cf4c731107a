"""What a HARTS plan means: sealing, decoding, the fast slice check, the oracle validator, the memory
model and the window exports (DESIGN §4.4, §5.5).

Both sides import it (`planner_service` builds and validates plans with it, `trainer` checks and
decodes the slices it runs); it imports only `proto` (the wire), numpy and numba, never torch,
FastAPI or gRPC. Modules: `seal` (deterministic bytes + SHA-256), `decode` (bounds-checked arrays,
`rank_plans`/`rank_steps`), `header` (the step-wide header rules), `phases` (lock-step phases,
stand-ins and their costs), `slice_check` with
`slice_kernels` (the fast check a trainer runs), `validator` with `oracle_rows`, `oracle_schedule`,
`oracle_stats` and `oracle_logprobs` (the independent oracle, written from the contract), `memory_model` (bytes of live activations), `window_exports` (what an exporter keeps),
`cross_edges` (windows across ranks: decoded edges, their rules, bytes, what moves when).
"""
