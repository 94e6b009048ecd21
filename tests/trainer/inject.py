"""Code for the sitecustomize modules the multi-process tests inject into every process they start.

`AFTER_IMPORT` defines `_after_import(module_name, patch)`: patch a module right after the program first
imports it, without importing it earlier than the program would (an early import of transformers would
change when each rank gets anywhere). The tests prepend it to their own sitecustomize code.
"""

AFTER_IMPORT = """
import importlib.abc
import importlib.util
import sys


def _after_import(module_name, patch):
    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != module_name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, Finder())
"""
