"""The Python sandbox as a verl tool, so verl's multi-turn rollouts (tool_agent loop, hermes tool
calls) use the same sandbox as the embedded backend. Imported only inside verl processes.

`tool_config(limits)` is the YAML verl reads from actor_rollout_ref.rollout.multi_turn.tool_config_path.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from benchmarks.generation.tools import SCHEMA  # the one definition of the tool, as the embedded backend's hermes prompt shows it
from benchmarks.generation.sandbox import Limits, require_isolation, run_python

class SandboxTool(BaseTool):  # verl's tool interface
    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema] = None):
        super().__init__(config, tool_schema or OpenAIFunctionToolSchema.model_validate(SCHEMA))
        self.limits = Limits(**config["limits"])
        require_isolation(self.limits)  # fail closed in verl's processes too

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        return instance_id or str(uuid4()), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code", "")
        if not isinstance(code, str) or not code.strip():
            return ToolResponse(text="error: no code given"), 0.0, {"status": "error"}
        obs = await asyncio.to_thread(run_python, code, self.limits)
        return ToolResponse(text=obs.text()), 0.0, {"status": obs.status, "elapsed_s": obs.elapsed_s}

    async def release(self, instance_id: str, **kwargs) -> None:
        return None


def tool_config(limits: Limits) -> dict:
    """The tool file verl reads: our sandbox with every limit of the recipe's rollout.tools."""
    from dataclasses import asdict

    return {"tools": [{
        "class_name": f"{__name__}.SandboxTool",
        "config": {"type": "native", "limits": asdict(limits)},
        "tool_schema": SCHEMA,
    }]}
