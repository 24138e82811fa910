"""Planning: the model catalog and sizing (Spec inputs -> Budget). Imports only api/ and engine/."""
