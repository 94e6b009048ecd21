"""Rendered `vllm serve` arguments and the validation of the typed settings.

The Cloud Run service passes exactly these arguments to the image, so a wrong flag here is a
service that never becomes ready; a bad value must fail at `pulumi preview` with a message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from demo.local_server import REMAINING, Served, rewrite_request
from serving.vllm_args import (
    DEFAULT_MODEL_PATH,
    VLLM_NEUTRAL_SAMPLING,
    VllmConfigError,
    VllmServerConfig,
    load_config,
    render_args,
    served_sampling_defaults,
)


def _flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


class TestMergedModel:
    """The default: one merged model folder from the bucket mount."""

    def test_model_path_comes_first_and_serve_is_not_repeated(self) -> None:
        args = render_args(VllmServerConfig())
        assert args[0] == DEFAULT_MODEL_PATH
        assert "serve" not in args

    def test_defaults(self) -> None:
        args = render_args(VllmServerConfig())
        assert _flag_value(args, "--served-model-name") == "gemma"
        assert _flag_value(args, "--dtype") == "auto"
        assert _flag_value(args, "--gpu-memory-utilization") == "0.9"
        assert _flag_value(args, "--tensor-parallel-size") == "1"
        assert _flag_value(args, "--host") == "0.0.0.0"
        assert _flag_value(args, "--port") == "8000"
        for absent in ("--max-model-len", "--enforce-eager", "--enable-lora", "--lora-modules"):
            assert absent not in args

    def test_everything_set(self) -> None:
        cfg = VllmServerConfig(
            model="/mnt/models/run-7/merged",
            served_model_name="gemma-emoji",
            max_model_len=4096,
            dtype="bfloat16",
            gpu_memory_utilization=0.85,
            tensor_parallel_size=2,
            host="127.0.0.1",
            port=8080,
            enforce_eager=True,
        )
        assert render_args(cfg) == [
            "/mnt/models/run-7/merged",
            "--served-model-name", "gemma-emoji",
            "--max-model-len", "4096",
            "--dtype", "bfloat16",
            "--gpu-memory-utilization", "0.85",
            "--tensor-parallel-size", "2",
            "--host", "127.0.0.1",
            "--port", "8080",
            "--generation-config", "vllm",
            "--override-generation-config", '{"temperature":0.0}',
            "--enforce-eager",
        ]  # fmt: skip

    def test_served_model_name_can_be_left_to_vllm(self) -> None:
        assert "--served-model-name" not in render_args(VllmServerConfig(served_model_name=None))

    def test_all_strings(self) -> None:
        """Cloud Run and Kubernetes `args` must be strings."""
        cfg = VllmServerConfig(lora_modules={"a": "/m/a"}, max_lora_rank=16, max_loras=2, max_model_len=2048)
        assert all(isinstance(a, str) for a in render_args(cfg))


class TestLoraAdapters:
    """Adapters served on the base model instead of a merge."""

    def test_enable_lora_and_modules(self) -> None:
        cfg = VllmServerConfig(
            model="/mnt/models/base",
            lora_modules={"emoji": "/mnt/models/emoji-adapter", "sql": "/mnt/models/sql-adapter"},
            max_lora_rank=16,
            max_loras=2,
        )
        args = render_args(cfg)
        assert args[0] == "/mnt/models/base"
        i = args.index("--lora-modules")
        assert args[i - 1] == "--enable-lora"
        assert args[i + 1 : i + 3] == ["emoji=/mnt/models/emoji-adapter", "sql=/mnt/models/sql-adapter"]
        assert _flag_value(args, "--max-lora-rank") == "16"
        assert _flag_value(args, "--max-loras") == "2"

    def test_lora_settings_without_adapters_are_rejected(self) -> None:
        with pytest.raises(VllmConfigError, match="max_lora_rank=16 is set but lora_modules is empty"):
            load_config({"max_lora_rank": 16})

    @pytest.mark.parametrize("rank", [0, 7, 1024])
    def test_rank_must_be_one_vllm_allows(self, rank: int) -> None:
        with pytest.raises(VllmConfigError, match=rf"max_lora_rank={rank}: vLLM allows \[1, 8, 16"):
            load_config({"lora_modules": {"a": "/m/a"}, "max_lora_rank": rank})

    @pytest.mark.parametrize("name", ["has space", "a=b", "-flag", ""])
    def test_adapter_names(self, name: str) -> None:
        with pytest.raises(VllmConfigError, match="lora_modules name"):
            load_config({"lora_modules": {name: "/m/a"}})


class TestExtraArgs:
    def test_passed_through_last_and_verbatim(self) -> None:
        args = render_args(VllmServerConfig(extra_args=["--kv-cache-dtype", "fp8", "--disable-log-requests"]))
        assert args[-3:] == ["--kv-cache-dtype", "fp8", "--disable-log-requests"]

    @pytest.mark.parametrize(
        ("arg", "field"),
        [
            ("--port", "port"),
            ("--port=9000", "port"),
            ("--max_model_len=8", "max_model_len"),
            ("-tp", "tensor_parallel_size"),
            ("--enable-lora", "lora_modules"),
            ("--model", "model"),
            ("--enforce-eager", "enforce_eager"),
        ],
    )
    def test_duplicates_of_typed_fields_are_rejected(self, arg: str, field: str) -> None:
        with pytest.raises(VllmConfigError, match=f"duplicates the typed field `{field}`: set `{field}` instead"):
            load_config({"extra_args": [arg, "1"]})

    def test_serve_is_rejected(self) -> None:
        with pytest.raises(VllmConfigError, match="already `vllm serve`"):
            load_config({"extra_args": ["serve"]})

    @pytest.mark.parametrize(
        "args", [["--api-key", "sk-secret-1"], ["--api_key=sk-secret-1"], ["--hf-token=sk-secret-1"]]
    )
    def test_secret_flags_are_rejected_without_repeating_the_value(self, args: list[str]) -> None:
        with pytest.raises(VllmConfigError) as info:
            load_config({"extra_args": args})
        assert "plain text" in str(info.value) and "sk-secret-1" not in str(info.value)

    @pytest.mark.parametrize(
        ("args", "refused", "reason"),
        [
            (["--api-k", "sk-secret-1"], "--api-key", "plain text"),
            (["--api_k=sk-secret-1"], "--api-key", "plain text"),
            (["--hf-t=sk-secret-1"], "--hf-token", "plain text"),
            (["--h", "sk-secret-1"], "--hf-token", "plain text"),  # ambiguous (--hf-token, --host): still refused
            (["--middle", "evil.Mw"], "--middleware", "before the API key guard"),
            (["--po=9000"], "--port", "duplicates the typed field `port`"),
            (["--max-lo", "4"], "--max-lora-rank", "duplicates the typed field"),  # ambiguous with --max-loras
        ],
    )
    def test_abbreviations_are_refused_like_the_flag(self, args: list[str], refused: str, reason: str) -> None:
        """vLLM's parser keeps argparse's allow_abbrev: `--api-k KEY` is `--api-key KEY`, `--po 9` is `--port 9`."""
        for guard in (True, False):
            with pytest.raises(VllmConfigError) as info:
                load_config({"api_key_guard": guard, "extra_args": args})
            message = str(info.value)
            assert refused in message and reason in message, message
            assert "sk-secret-1" not in message and "9000" not in message and "evil" not in message

    @pytest.mark.parametrize(
        ("args", "refused", "reason"),
        [
            (["--override-generation-config.temperature", "0.7"], "--override-generation-config", "fixed"),
            (["--override_generation_config.top_k=64"], "--override-generation-config", "fixed"),
            (["--override-gen.temperature", "0.7"], "--override-generation-config", "fixed"),
            (["--api-key.k", "sk-secret-1"], "--api-key", "plain text"),
            (["--hf-token.x=sk-secret-1"], "--hf-token", "plain text"),
            (["--middleware.x", "evil.Mw"], "--middleware", "before the API key guard"),
            (["--max-model-len.x=9000"], "--max-model-len", "duplicates the typed field `max_model_len`"),
        ],
    )
    def test_dotted_json_keys_are_refused_like_the_flag(self, args: list[str], refused: str, reason: str) -> None:
        """vLLM's FlexibleArgumentParser.parse_args (vllm/utils/argparse_utils.py, v0.28.0) turns
        `--NAME.key value` into `--NAME '{"key": value}'` appended after every other arg, so the last one wins:
        `--override-generation-config.temperature 0.7` would replace the served greedy default."""
        with pytest.raises(VllmConfigError) as info:
            load_config({"extra_args": args})
        message = str(info.value)
        assert refused in message and reason in message, message
        assert "sk-secret-1" not in message and "9000" not in message and "evil" not in message

    def test_flags_that_are_no_prefix_of_a_refused_one_pass(self) -> None:
        extra = [
            "--no-enable-prefix-caching",
            "--max-lora-rank-x",
            "--disable-log-requests",
            "--pipeline-parallel-size",
            "1",
        ]
        assert load_config({"extra_args": extra}).extra_args == extra


class TestBadValues:
    """Each message names the field, the value and what is allowed."""

    @pytest.mark.parametrize(
        ("data", "expected"),
        [
            ({"gpu_memory_utilization": 0}, "gpu_memory_utilization=0.0: must be a fraction with 0 < x <= 1"),
            ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization=1.2: must be a fraction with 0 < x <= 1"),
            ({"dtype": "float32"}, "dtype: 'float32' is not allowed; use one of ['auto', 'bfloat16', 'float16']"),
            ({"tensor_parallel_size": 0}, "tensor_parallel_size=0: must be at least 1"),
            ({"port": 70000}, "port=70000: must be between 1 and 65535"),
            ({"max_model_len": -1}, "max_model_len=-1: must be a positive number of tokens"),
            ({"model": ""}, "model='': give a folder path"),
            ({"model": "--model"}, "looks like a flag"),
            ({"served_model_name": "my model"}, "served_model_name='my model': use letters"),
            ({"max_loras": 0, "lora_modules": {"a": "/m"}}, "max_loras=0: must be at least 1"),
            ({"gpu_memory": 0.9}, "gpu_memory: unknown setting (allowed: model, served_model_name"),
        ],
    )
    def test_message(self, data: dict[str, object], expected: str) -> None:
        with pytest.raises(VllmConfigError) as info:
            load_config(data)
        assert expected in str(info.value)

    def test_every_problem_is_listed(self) -> None:
        with pytest.raises(VllmConfigError) as info:
            load_config({"port": 0, "tensor_parallel_size": 0})
        assert "port=0" in str(info.value) and "tensor_parallel_size=0" in str(info.value)

    def test_direct_construction_also_validates(self) -> None:
        with pytest.raises(ValidationError, match="gpu_memory_utilization=2"):
            VllmServerConfig(gpu_memory_utilization=2)

    def test_frozen(self) -> None:
        cfg = VllmServerConfig()
        with pytest.raises(ValidationError):
            cfg.port = 1  # type: ignore[misc]


def test_imports_only_pydantic_and_stdlib() -> None:
    """The Pulumi program imports this module; `pulumi up` has no torch or vLLM."""
    import subprocess
    import sys

    code = (
        "import sys; import serving.vllm_args; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'transformers', 'vllm', 'numpy', 'yaml'}); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


class TestWhatVllmWouldRefuse:
    """vLLM refuses float16 for Gemma 2/3 at start-up (vllm/config/model.py); here it fails at preview."""

    @pytest.mark.parametrize(
        "data",
        [
            {"model": "google/gemma-3-1b-it", "dtype": "float16"},
            {"model": "/mnt/models/runs/emoji-gemma3-1b-abc/merged", "dtype": "float16"},
            {"model": "/mnt/models/merged", "model_type": "gemma3_text", "dtype": "float16"},
            {"model": "google/gemma-2-2b-it", "dtype": "float16"},
        ],
    )
    def test_float16_for_gemma_is_refused(self, data: dict[str, object]) -> None:
        with pytest.raises(VllmConfigError, match=r"vLLM refuses float16 for Gemma 2/3.*Use dtype=bfloat16"):
            load_config(data)

    def test_other_dtypes_and_models_pass(self) -> None:
        load_config({"model": "google/gemma-3-1b-it", "dtype": "bfloat16"})
        load_config({"model": "/mnt/models/merged", "dtype": "float16"})  # nothing says it is Gemma 2/3
        load_config({"model": "google/gemma-3-1b-it", "model_type": "llama", "dtype": "float16"})


def test_max_num_seqs_is_rendered_and_not_duplicated() -> None:
    assert render_args(VllmServerConfig(max_num_seqs=256))[-2:] == ["--max-num-seqs", "256"]
    with pytest.raises(VllmConfigError, match="duplicates the typed field `max_num_seqs`"):
        load_config({"extra_args": ["--max-num-seqs", "8"]})


class TestApiKeyGuard:
    """vLLM alone checks the key only under /v1, /v2, /inference, /cohere (vllm-project/vllm#58144); a server with a
    key gets serving/api_key_guard.py through `--middleware` (tests/serving/test_api_key_guard.py runs it)."""

    def test_rendered_iff_set(self) -> None:
        assert "--middleware" not in render_args(VllmServerConfig())
        args = render_args(VllmServerConfig(api_key_guard=True))
        assert args[args.index("--middleware") + 1] == "serving.api_key_guard.ApiKeyGuard"
        assert args.count("--middleware") == 1

    def test_the_import_path_names_the_guard_class(self) -> None:
        import importlib
        import inspect

        from serving.api_key_guard import ApiKeyGuard
        from serving.vllm_args import API_KEY_GUARD_MIDDLEWARE

        module_path, object_name = API_KEY_GUARD_MIDDLEWARE.rsplit(".", 1)  # as vLLM's build_app splits it
        imported = getattr(importlib.import_module(module_path), object_name)
        assert imported is ApiKeyGuard and inspect.isclass(imported)

    @pytest.mark.parametrize(
        "extra",
        [["--middleware", "my.Mw"], ["--middleware=my.Mw"], ["--middleware", "serving.api_key_guard.ApiKeyGuard"]],
    )
    def test_middleware_in_extra_args_is_refused(self, extra: list[str]) -> None:
        """vLLM appends every --middleware; one added after the guard is outermost and sees requests first.

        The refusal used to give a false reason (that vLLM keeps only the last --middleware).
        """
        for guard in (True, False):
            with pytest.raises(VllmConfigError, match="see every request before the API key guard") as info:
                load_config({"api_key_guard": guard, "extra_args": extra})
            assert "keeps only the last" not in str(info.value) and "replace" not in str(info.value)

    def test_no_doc_gives_the_false_reason_for_refusing_middleware(self) -> None:
        """vLLM does not keep only the last --middleware (FrontendArgs.middleware is action="append")."""
        root = Path(__file__).resolve().parents[2]
        docs = ["README.md", *sorted(str(p.relative_to(root)) for p in (root / "docs").rglob("*.md"))]
        assert "docs/serving.md" in docs
        for doc in (*docs, "serving/README.md", "Pulumi.yaml", "serving/vllm_args.py", "infra/config.py"):
            text = " ".join((root / doc).read_text(encoding="utf-8").split())
            for false in ("keeps only the last", "would replace the API key guard", "replace the guard"):
                assert false not in text, f"{doc}: {false!r}"


# google/gemma-3-1b-it generation_config.json as the export keeps it (GenerationConfig.to_diff_dict: the
# non-default values): the base's sampling settings.
GEMMA3_EXPORT_GENERATION_CONFIG: dict[str, Any] = {
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "do_sample": True,
    "eos_token_id": [1, 106],
    "pad_token_id": 0,
    "top_k": 64,
    "top_p": 0.95,
}
SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_p", "top_k", "min_p")


def _vllm_request_sampling(args: list[str], model_generation_config: dict[str, Any], request: dict[str, Any]) -> dict:
    """What vLLM v0.28.0 samples a request with, replayed from its source:
    `ModelConfig.get_diff_sampling_param` (vllm/config/model.py: {} for "vllm", else the model's generation
    config; then the override; only the sampling keys) and `ChatCompletionRequest.to_sampling_params`
    (vllm/entrypoints/openai/chat_completion/protocol.py: the request's value, else that diff, else
    `_DEFAULT_SAMPLING_PARAMS`)."""
    src = args[args.index("--generation-config") + 1] if "--generation-config" in args else "auto"
    override = (
        json.loads(args[args.index("--override-generation-config") + 1])
        if "--override-generation-config" in args
        else {}
    )
    config = {} if src == "vllm" else dict(model_generation_config)
    config.update(override)
    available = ["repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens"]
    diff = {p: config[p] for p in available if config.get(p) is not None}
    return {
        p: request[p] if request.get(p) is not None else diff.get(p, VLLM_NEUTRAL_SAMPLING[p]) for p in SAMPLING_KEYS
    }


class TestServedSamplingDefaults:
    """A request without `temperature` (the README's openai snippet) is greedy in the cloud, as locally."""

    def test_a_request_without_sampling_settings_is_greedy_on_vllm(self) -> None:
        args = render_args(VllmServerConfig())
        served = _vllm_request_sampling(args, GEMMA3_EXPORT_GENERATION_CONFIG, {"messages": []})
        assert served["temperature"] == 0.0
        assert served == {p: served_sampling_defaults()[p] for p in SAMPLING_KEYS}

    def test_the_local_server_takes_the_same_defaults(self) -> None:
        """demo/local_server.py's layer sends transformers serve the temperature and top_p vLLM would use."""
        args = render_args(VllmServerConfig())
        served = Served("gemma", "/m", None)
        for path, body in (("/v1/chat/completions", {"messages": []}), ("/v1/completions", {"prompt": "hi"})):
            vllm = _vllm_request_sampling(args, GEMMA3_EXPORT_GENERATION_CONFIG, body)
            local = rewrite_request(served, path, body)
            assert (local["temperature"], local["top_p"]) == (vllm["temperature"], vllm["top_p"])

    def test_a_request_that_asks_for_sampling_gets_vllms_neutral_top_p_not_the_bases(self) -> None:
        """temperature=0.8 alone: top_p stays vLLM's neutral 1.0, not Gemma's 0.95; top_k, which the OpenAI chat API
        cannot carry to transformers serve, is the one difference left, and named (REMAINING)."""
        args = render_args(VllmServerConfig())
        body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.8}
        vllm = _vllm_request_sampling(args, GEMMA3_EXPORT_GENERATION_CONFIG, body)
        local = rewrite_request(Served("gemma", "/m", None), "/v1/chat/completions", body)
        assert vllm["temperature"] == local["temperature"] == 0.8
        assert vllm["top_p"] == local["top_p"] == 1.0 and vllm["top_k"] == 0 and "top_k" in REMAINING

    @pytest.mark.parametrize("flag", ["--generation-config=auto", "--override-generation-config", "--generation-c"])
    def test_extra_args_cannot_change_them(self, flag: str) -> None:
        with pytest.raises(ValidationError, match="served sampling defaults are fixed"):
            VllmServerConfig(extra_args=[flag])


class TestNoDevelopmentRoutes:
    """`extra_args` may not add vLLM routes meant for local development, which every caller of the service could
    use (vLLM v0.28.0): the profiler's /start_profile and /stop_profile (vllm/entrypoints/serve/profile/api_router.py,
    attached whenever --profiler-config names a profiler) and /fault_tolerance/apply
    (vllm/entrypoints/serve/fault_tolerance/api_router.py, with --enable-fault-tolerance or --fault-tolerance-config)."""

    @pytest.mark.parametrize(
        ("args", "refused", "route"),
        [
            (["--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/tmp/p"}'], "--profiler-config", "/start_profile"),
            (["--profiler-config.profiler", "torch"], "--profiler-config", "/start_profile"),
            (["--profiler_config={}"], "--profiler-config", "/start_profile"),
            (["--enable-fault-tolerance"], "--enable-fault-tolerance", "/fault_tolerance/apply"),
            (["--fault-tolerance-config", "{}"], "--fault-tolerance-config", "/fault_tolerance/apply"),
        ],
    )  # fmt: skip
    def test_refused_with_the_routes_they_open(self, args: list[str], refused: str, route: str) -> None:
        with pytest.raises(VllmConfigError) as info:
            load_config({"extra_args": args})
        message = str(info.value)
        assert refused in message and route in message, message

    def test_turning_them_off_passes(self) -> None:
        assert load_config({"extra_args": ["--no-enable-fault-tolerance"]}).extra_args == [
            "--no-enable-fault-tolerance"
        ]
