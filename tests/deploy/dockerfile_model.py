"""docker/*.Dockerfile as the tests read them: the steps of the image's last stage."""
import json
import re
from pathlib import Path


def final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the image's last stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    steps = [tuple((line.split(None, 1) + [""])[:2]) for line in map(str.strip, text.splitlines())
             if line and not line.startswith("#")]
    last_from = max(i for i, (instruction, _) in enumerate(steps) if instruction == "FROM")
    return [(instruction.upper(), args) for instruction, args in steps[last_from:]]


def entrypoint(dockerfile: Path) -> list[str]:
    """The image's ENTRYPOINT (the exec form, a JSON list)."""
    [args] = [args for instruction, args in final_stage(dockerfile) if instruction == "ENTRYPOINT"]
    return json.loads(args)
