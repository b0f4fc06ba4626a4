"""Names users import from the Rec SDK's paths that belong to capabilities not built yet.

Each raises NotImplementedError naming the capability when used, so a script that relies on it
fails loudly instead of training something else.
"""


def not_built(name, capability):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"{name} is not available yet: shardrec does not implement {capability} yet")

    missing.__name__ = name.rsplit(".", 1)[-1]
    missing.__qualname__ = missing.__name__
    return missing


class NotBuiltClass:
    """Base for classes (hooks) whose capability is not built yet."""

    capability = "this capability"

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{type(self).__name__} is not available yet: shardrec does not implement {self.capability} yet"
        )


# Feature admission and eviction (seed 002).
class EvictHook(NotBuiltClass):
    capability = "feature admission and eviction"

