"""The local demo: the cloud pipeline on this machine's CPU, and the server it queries.

- `demo.pipeline`: `make demo`: fine-tune Gemma 3 270M here, score, merge, serve, query
- `demo.local_server`: a local OpenAI-compatible server for a merged model folder (CPU)

Nothing here ships in an image; the served model in the cloud runs vLLM (`serving/`).
"""
