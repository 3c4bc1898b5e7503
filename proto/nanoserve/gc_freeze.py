"""Keeps the garbage collector off the objects a service builds while starting.

A full collection walks every tracked object: after a worker has loaded its model and compiled and
captured its kernels, or a scheduler has loaded its tokenizer, that is millions of objects and tens
of milliseconds, paid at random in the middle of a step or a stream's write. Frozen objects move to
a permanent generation that collections skip; what serving allocates is still collected."""
import gc


def freeze_start_up_objects() -> None:
    """Collects what start-up left as garbage, then freezes everything still alive. Call once the
    service is ready (again after a reload: only new objects move)."""
    gc.collect()
    gc.freeze()
