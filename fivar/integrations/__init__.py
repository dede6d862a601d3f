"""fivar inside other libraries' models (`fivar.integrations.transformers`)."""
