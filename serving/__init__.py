"""Serving: the vLLM image and its arguments, and an OpenAI-compatible chat client.

- `serving.vllm_args`   typed vLLM server settings rendered to `vllm serve` arguments (the
                        Pulumi program imports it, so it needs only pydantic and the stdlib)
- `serving.completion`  the one definition of a complete export (marker + inventory + readable
                        files), stdlib only; also copied into the serving image
- `serving.api_key_guard` the ASGI middleware vLLM loads (`--middleware`) when the service has an
                        API key: the key on every route but /health. Starlette + stdlib; this
                        file and it are copied into the serving image
- `serving.startup`     the Cloud Run startup window, stated once with its sources
- `serving.client`      a stdlib-only chat client for Cloud Run (identity token) or 127.0.0.1

The local demo and its CPU server live in `demo/`. This package deliberately imports nothing heavy at
import time: torch and transformers are loaded only inside the functions that need them.
"""
