"""The HARTS wire contract (`harts.v1`): the .proto files, their generated modules and the array codecs.

Only the wire lives here: what a plan means (sealing, decoding, checks, the memory model) is the
`plan` package. `proto/` depends on numpy and protobuf only; `planner_service`, `trainer` and
`harts_client` import it and never each other (docs/design/plan-contract.md).
"""
