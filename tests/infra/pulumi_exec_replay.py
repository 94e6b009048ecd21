"""What Pulumi's `pulumi-language-python-exec` does with the program, under the project's mocks.

Run by tests/infra/test_pulumi_install.py with the python of the virtualenv the replay of
Pulumi's install created (never the dev venv): `python pulumi_exec_replay.py ROOT PROGRAM_DIR
STACK...`. It keeps the steps of pulumi/pulumi v3.259.0 sdk/python/cmd/pulumi-language-python-exec
(`__main__`): `import pulumi` first (an empty venv fails here), the config and the engine are set
(here: `infra.offline.engine.mock_engine` instead of a monitor address), `os.chdir(--pwd)`, then
`runpy.run_path(PROGRAM, run_name="__main__")` inside `pulumi.runtime.run_in_stack` (here its inner
`run_pulumi_func`: `pulumi.runtime.set_mocks` has made the root Stack already). PROGRAM is
".", the entry point `pulumi.yaml`'s `main` directory resolves to (pkg/engine/project.go,
`getPwdMain`). The mocks come from the copy of the repo; the repo root is taken off `sys.path`
and `infra` out of `sys.modules` again before the program runs, so `infra/__main__.py` must find
its own imports as it does under Pulumi. Prints one JSON line per stack.
"""

from __future__ import annotations

import asyncio
import json
import os
import runpy
import sys


def main() -> None:
    import pulumi  # pulumi-language-python-exec imports it before anything else
    import pulumi.runtime
    from pulumi.runtime.stack import run_pulumi_func

    root, program_dir, stacks = sys.argv[1], sys.argv[2], sys.argv[3:]
    for stack in stacks:
        loop = asyncio.new_event_loop()  # before the engine is set: its futures belong to this loop
        asyncio.set_event_loop(loop)
        sys.path.insert(0, root)
        from infra.offline import engine as offline

        _mocks, monitor, warnings = offline.mock_engine(stack)
        sys.path.remove(root)
        for name in [m for m in sys.modules if m == "infra" or m.startswith("infra.")]:
            del sys.modules[name]

        os.chdir(program_dir)  # --pwd: the program directory
        sys.argv = ["."]
        loop.run_until_complete(run_pulumi_func(lambda: runpy.run_path(".", run_name="__main__")))
        loop.close()
        outputs = pulumi.runtime.get_root_resource().outputs  # type: ignore[union-attr]
        print(
            json.dumps(
                {
                    "stack": stack,
                    "types": sorted({r.type for r in monitor.recorded}),
                    "resources": len(monitor.recorded),
                    "outputs": sorted(outputs),
                    "warnings": warnings.messages,
                    "sys_path_has_root": root in sys.path,
                    "pulumi_file": pulumi.__file__,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
