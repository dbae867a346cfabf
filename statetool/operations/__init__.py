"""Operations: each a function taking a :class:`~statetool.operations.context.Context` and
returning a result dataclass; failures raise :class:`~statetool.errors.StateError`."""
