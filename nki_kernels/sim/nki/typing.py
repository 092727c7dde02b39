"""``nki.typing``: annotation helpers (``nt.tensor[...]``); annotations are not enforced by the simulator."""


class _Annotation:
    def __class_getitem__(cls, item):
        return cls


class tensor(_Annotation):
    pass


class mutable_tensor(_Annotation):
    pass


class scalar(_Annotation):
    pass
