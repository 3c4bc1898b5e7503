"""Reports Triton kernels compiled after start-up.

Every variant a step can use is compiled while the worker starts (warm-up steps, graph capture);
a compile while serving stalls every running request for the ~1 s it takes, so it is a bug in the
warm-up (or a kernel that specialises on something that changes from step to step), and the log
names the kernel and its specialisation."""
import logging


def warn_on_compiles(log: logging.Logger) -> None:
    """From now on, a Triton compile in this process logs a warning."""
    import triton  # a GPU requirement only

    def compiled(*, repr: str, **_) -> None:
        log.warning("compiled a Triton kernel while serving (a variant start-up did not warm): %s", repr)

    triton.knobs.runtime.jit_post_compile_hook = compiled
