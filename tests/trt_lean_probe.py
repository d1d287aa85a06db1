"""Runs steps against TensorRT's lean runtime in a fresh process and prints what happened as JSON.

The plugin registry is global to a process and a library opened with CDLL stays loaded, so every
loading scenario of tests/runtimes/test_trt_lean.py runs in its own process through this script:

    python trt_lean_probe.py STEP_JSON    (ROPE_EXPORT_TRT_LEAN_PATH: folder put first on sys.path)

STEP_JSON is a list of steps, run in order:
    ["import"]                          import tensorrt_lean
    ["cdll", path]                      ctypes.CDLL(path), as polygraphy --plugins / Triton open a library
    ["load", path]                      registry.load_library(path), as trtexec --dynamicPlugins does
    ["deregister"]                      registry.deregister_library(the last handle load returned)
    ["creators"]                        our creators in the registry, and the creator's declared fields
    ["create", phase, fields]           creator.create_plugin("layer0", fields, phase); fields are
                                        [name, PluginFieldType name, values] ("NONE": no data at all)
Each step's record is printed as one JSON list on stdout's last line.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

NAME, VERSION, NAMESPACE = "RopeExportRotaryEmbedding", "1", "rope_export"
NUMPY_TYPES = {"INT32": "int32", "INT64": "int64", "INT8": "int8", "INT16": "int16", "FLOAT32": "float32",
               "FLOAT64": "float64", "FLOAT16": "float16"}


def _field(trt, np, name, type_name, values):
    if type_name == "NONE":
        return trt.PluginField(name)
    kind = getattr(trt.PluginFieldType, type_name)
    if type_name == "CHAR":
        data = np.frombuffer(str(values).encode(), dtype=np.int8).copy()
    else:
        data = np.array(values, dtype=NUMPY_TYPES[type_name])
    return trt.PluginField(name, data, kind)


def main(steps: list) -> list[dict]:
    trt = None
    registry = None
    handle = None
    out = []
    for step in steps:
        record: dict = {"step": step[0]}
        if step[0] == "import":
            import tensorrt_lean as trt

            registry = trt.get_plugin_registry()
            record["version"] = trt.__version__
        elif step[0] == "cdll":
            ctypes.CDLL(step[1])
        elif step[0] == "load":
            handle = registry.load_library(step[1])
            record["handle"] = handle is not None
        elif step[0] == "deregister":
            registry.deregister_library(handle)
        elif step[0] == "creators":
            ours = [c for c in registry.all_creators if c.name == NAME]
            record["ours"] = [[c.name, c.plugin_version, c.plugin_namespace, type(c).__name__] for c in ours]
            record["total"] = len(registry.all_creators)
            creator = registry.get_creator(NAME, VERSION, NAMESPACE)
            record["found"] = creator is not None
            if creator is not None:
                record["field_names"] = [[f.name, f.type.name, f.size] for f in creator.field_names]
        elif step[0] == "create":
            import numpy as np

            creator = registry.get_creator(NAME, VERSION, NAMESPACE)
            phase = getattr(trt.TensorRTPhase, step[1])
            fields = trt.PluginFieldCollection([_field(trt, np, *f) for f in step[2]])
            plugin = creator.create_plugin("layer0", fields, phase)
            record["created"] = plugin is not None
            if plugin is not None:
                core = plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
                build = plugin.get_capability_interface(trt.PluginCapabilityType.BUILD)
                record["identity"] = [core.plugin_name, core.plugin_version, core.plugin_namespace]
                record["num_outputs"] = build.num_outputs
                record["metadata"] = build.metadata_string
                record["timing_cache_id"] = build.timing_cache_id
        else:
            raise SystemExit(f"unknown step {step[0]!r}")
        out.append(record)
        sys.stderr.flush()
    return out


if __name__ == "__main__":
    extra = os.environ.get("ROPE_EXPORT_TRT_LEAN_PATH")
    if extra:
        sys.path.insert(0, extra)
    result = main(json.loads(sys.argv[1]))
    print(json.dumps(result))
