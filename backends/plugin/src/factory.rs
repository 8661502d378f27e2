//! [`PluginFactory`]: the registry entry `plugin`.
//!
//! Extra-config fields (`backend plugin`, strict like every backend):
//! - `plugin_path` (required): the plugin's shared library. A path with a `/` must exist; a
//!   bare file name is searched by the dynamic loader (`LD_LIBRARY_PATH`, …).
//! - `plugin_config` (optional, default `{}`): the plugin's own configuration, a JSON object,
//!   or a string holding one (handy when it comes from an environment variable). It is
//!   handed to the plugin's `create` as JSON text; the plugin checks its fields.
//!
//! The common `capacity` field reaches the plugin as `hicache_host.capacity_bytes`.

use std::sync::Arc;

use async_trait::async_trait;
use hicache_storage::{
    BackendContext, BackendFactory, CommonConfig, ConfigFields, Registry, Result, Storage,
};
use serde_json::Value;

use crate::storage::{HostParams, PluginStorage};

/// Opens [`PluginStorage`]s from the extra-config; registered as `plugin`.
#[derive(Copy, Clone, Debug, Default)]
pub struct PluginFactory;

/// Reads `plugin_path` and `plugin_config` (as JSON text) and finishes the fields.
pub fn parse_fields(mut fields: ConfigFields) -> Result<(String, String)> {
    let path = fields.string("plugin_path")?;
    let config = match fields.opt_value("plugin_config") {
        None => "{}".to_string(),
        Some(Value::Object(m)) => Value::Object(m).to_string(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(&s) {
            Ok(Value::Object(m)) => Value::Object(m).to_string(),
            Ok(other) => {
                return Err(fields.error(
                    "plugin_config",
                    &Value::String(s),
                    format!("the string must hold a JSON object, it holds {other}"),
                ));
            }
            Err(e) => {
                return Err(fields.error(
                    "plugin_config",
                    &Value::String(s),
                    format!("invalid JSON: {e}"),
                ));
            }
        },
        Some(v) => {
            return Err(fields.error(
                "plugin_config",
                &v,
                "expected a JSON object (or a string holding one)",
            ));
        }
    };
    fields.finish()?;
    Ok((path, config))
}

#[async_trait]
impl BackendFactory for PluginFactory {
    fn name(&self) -> &str {
        crate::NAME
    }

    async fn open(
        &self,
        common: &CommonConfig,
        fields: ConfigFields,
        ctx: &BackendContext,
    ) -> Result<Arc<dyn Storage>> {
        let (path, config) = parse_fields(fields)?;
        let storage = PluginStorage::open(&path, &config, &HostParams::new(common, ctx))?;
        Ok(Arc::new(storage))
    }
}

/// Adds the plugin backend to `registry` under the name `plugin`.
pub fn register(registry: &Registry) -> Result<()> {
    registry.register(PluginFactory)
}

#[cfg(test)]
mod tests {
    use hicache_storage::StorageConfig;

    use super::*;

    fn fields(extra: &str) -> ConfigFields {
        StorageConfig::parse(None, Some(extra))
            .unwrap()
            .backend_fields
    }

    #[test]
    fn plugin_config_forms() {
        let (p, c) = parse_fields(fields(
            r#"{"backend": "plugin", "plugin_path": "/x/libp.so", "plugin_config": {"a": 1}}"#,
        ))
        .unwrap();
        assert_eq!((p.as_str(), c.as_str()), ("/x/libp.so", r#"{"a":1}"#));
        let (_, c) =
            parse_fields(fields(r#"{"backend": "plugin", "plugin_path": "libp.so"}"#)).unwrap();
        assert_eq!(c, "{}");
        let (_, c) = parse_fields(fields(
            r#"{"backend": "plugin", "plugin_path": "p.so", "plugin_config": "{\"b\": [2]}"}"#,
        ))
        .unwrap();
        assert_eq!(c, r#"{"b":[2]}"#);
    }

    #[test]
    fn bad_fields_name_themselves() {
        let e = parse_fields(fields(
            r#"{"backend": "plugin", "plugin_path": "p.so", "plugin_config": "{nope"}"#,
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("plugin_config") && e.contains("invalid JSON"),
            "{e}"
        );
        let e = parse_fields(fields(
            r#"{"backend": "plugin", "plugin_path": "p.so", "plugin_config": "[1]"}"#,
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("plugin_config") && e.contains("JSON object"),
            "{e}"
        );
        let e = parse_fields(fields(
            r#"{"backend": "plugin", "plugin_path": "p.so", "plugin_config": 7}"#,
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("plugin_config") && e.contains('7'), "{e}");
        let e = parse_fields(fields(r#"{"backend": "plugin"}"#))
            .unwrap_err()
            .to_string();
        assert!(e.contains("plugin_path") && e.contains("required"), "{e}");
        let e = parse_fields(fields(
            r#"{"backend": "plugin", "plugin_path": "p.so", "plugin_conf": {}}"#,
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("plugin_conf") && e.contains("known fields"),
            "{e}"
        );
    }
}
