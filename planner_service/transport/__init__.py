"""The planner service's transports: thin adapters over one core (docs/design/service.md).

    http.py            FastAPI routes (`create_app`), OpenAPI at /docs
    http_models.py     the JSON bodies (pydantic), the topology's built from its one declaration
    http_errors.py     HTTP error answers and their OpenAPI documentation
    http_guard.py      the HTTP connection guard (header, body and idle timeouts, a connection bound)
    grpc_servicer.py   harts.v1.Planner, grpc.health.v1 and reflection (`add_to_server`)
    auth.py            the bearer token, one check for both transports
    status_codes.py    the one table: project errors -> HTTP status and gRPC code
    api_docs.py        Swagger UI / ReDoc from local assets, the OpenAPI request examples
"""
