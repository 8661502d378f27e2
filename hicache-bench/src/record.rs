//! The bench output convention: every bench prints one JSON object per measured case (with
//! `--json`), carrying the physical-limit reference measured in the same run (raw I/O of the
//! same bytes, a bulk copy, the no-cache engine) and the ratio to it, so a figure is never read
//! without the limit it is measured against.

use serde::Serialize;

/// One measured case.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Record {
    /// Bench name (`tree`, `storage`, `transfer`, …).
    pub bench: String,
    /// Case name, e.g. `file/write/8MiB`.
    pub case: String,
    /// The measured figure.
    pub value: f64,
    /// Its unit (`GB/s`, `req/s`, `us`, …).
    pub unit: String,
    /// The reference measured in the same run, where one applies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference: Option<f64>,
    /// `value / reference`, where a reference applies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
    /// Further figures of the case (totals, counts), flattened into the object.
    #[serde(flatten, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Record {
    /// A case without a reference.
    pub fn new(bench: &str, case: impl Into<String>, value: f64, unit: &str) -> Self {
        Self {
            bench: bench.to_string(),
            case: case.into(),
            value,
            unit: unit.to_string(),
            reference: None,
            ratio: None,
            extra: serde_json::Map::new(),
        }
    }

    /// Adds the reference measured in the same run and computes the ratio.
    pub fn with_reference(mut self, reference: f64) -> Self {
        self.reference = Some(reference);
        self.ratio = (reference > 0.0).then(|| self.value / reference);
        self
    }

    /// Adds a further figure.
    pub fn with(mut self, key: &str, value: impl Into<serde_json::Value>) -> Self {
        self.extra.insert(key.to_string(), value.into());
        self
    }

    /// The JSON line.
    pub fn to_json_line(&self) -> String {
        serde_json::to_string(self).expect("a record of plain numbers and strings serialises")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_line_has_the_design_fields() {
        let r = Record::new("storage", "file/write/8MiB", 1.93, "GB/s").with_reference(2.0);
        let v: serde_json::Value = serde_json::from_str(&r.to_json_line()).unwrap();
        assert_eq!(v["bench"], "storage");
        assert_eq!(v["unit"], "GB/s");
        assert!((v["ratio"].as_f64().unwrap() - 0.965).abs() < 1e-9);
        let plain = Record::new("tree", "replay", 5.0, "req/s").with("requests", 10);
        let v: serde_json::Value = serde_json::from_str(&plain.to_json_line()).unwrap();
        assert!(v.get("reference").is_none());
        assert_eq!(v["requests"], 10);
    }
}
