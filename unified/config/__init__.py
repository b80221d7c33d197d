from unified.config.schema import RunConfig, register_schemas

__all__ = ["RunConfig", "register_schemas"]
