"""The OpenAI-compatible HTTP gateway: FastAPI on uvicorn, a gRPC client of the scheduler's
public nanoserve.v1.LLM API. Imports no torch and nothing of the other services."""
