"""Fault injection for tests/adversarial/test_operator_poison_request.py: on PYTHONPATH of
a `weft up` with WEFT_TEST_POISON=1, every executor's ``LLMEngine.step`` raises SystemExit
(the engine thread ends) while it holds a request whose prompt starts with POISON, the
way a prompt that trips an engine bug would. Other processes are untouched."""
import importlib.abc
import importlib.util
import os
import sys

POISON = [1001, 1002, 1003]


class _PatchEngine(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "services.executor.engine.engine":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            real_step = module.LLMEngine.step

            def step(self):
                if any(list(seq.prompt_token_ids[:len(POISON)]) == POISON for seq in self.requests.values()):
                    raise SystemExit("injected: a poison prompt ends the engine thread")
                return real_step(self)

            module.LLMEngine.step = step

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("WEFT_TEST_POISON") == "1":
    sys.meta_path.insert(0, _PatchEngine())
