"""The original SonicMoE's import paths over this library, for code (and tests) written against `sonicmoe`:

    import sonicmoe_cpp.original
    sonicmoe_cpp.original.install()          # then: from sonicmoe import MoE, KernelBackendMoE, enable_quack_gemm
                                             #       from sonicmoe.enums import ActivationType
                                             #       from sonicmoe.functional import moe_TC_softmax_topk_layer

install() registers modules named `sonicmoe`, `sonicmoe.enums`, `sonicmoe.functional` and `sonicmoe.moe` in
sys.modules whose names are this library's (python/README.md lists the deliberate differences). It refuses to
replace an imported `sonicmoe` that is not its own.
"""
import sys
import types

import sonicmoe_cpp as _sm

# The original's module layout: which of its names each module holds.
_LAYOUT = {
    "sonicmoe": ("MoE", "KernelBackendMoE", "count_cumsum", "enable_quack_gemm", "moe_TC_softmax_topk_layer"),
    "sonicmoe.enums": ("ActivationType", "KernelBackendMoE", "is_glu"),
    "sonicmoe.functional": ("moe_TC_softmax_topk_layer", "moe_general_routing_inputs", "enable_quack_gemm",
                            "is_using_quack_gemm"),
    "sonicmoe.moe": ("MoE", "Experts"),
}


def _make(name: str) -> types.ModuleType:
    mod = types.ModuleType(name, f"The original's {name} over sonicmoe_cpp (sonicmoe_cpp.original).")
    mod.__sonicmoe_cpp_alias__ = True
    for attr in _LAYOUT[name]:
        setattr(mod, attr, getattr(_sm, attr))
    return mod


def install() -> types.ModuleType:
    """Registers the `sonicmoe` alias modules (idempotent) and returns the top-level one."""
    current = sys.modules.get("sonicmoe")
    if current is not None and not getattr(current, "__sonicmoe_cpp_alias__", False):
        raise RuntimeError("sonicmoe_cpp.original.install: a module named 'sonicmoe' (the original package?) is "
                           f"already imported from {getattr(current, '__file__', '?')}; install the alias first or "
                           "in a process without it")
    mods = {name: sys.modules.get(name) if current is not None else None for name in _LAYOUT}
    for name in _LAYOUT:
        if mods[name] is None:
            mods[name] = sys.modules[name] = _make(name)
    top = mods["sonicmoe"]
    top.__path__ = []  # a package, so that `import sonicmoe.enums` finds the registered submodules
    for name in _LAYOUT:
        if name != "sonicmoe":
            setattr(top, name.split(".", 1)[1], mods[name])
    return top


def uninstall() -> None:
    """Removes the alias modules that install() registered."""
    for name in _LAYOUT:
        if getattr(sys.modules.get(name), "__sonicmoe_cpp_alias__", False):
            del sys.modules[name]
