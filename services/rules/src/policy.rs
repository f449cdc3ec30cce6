//! The policy document as an operator writes it (JSON or YAML), its checks that need no
//! CEL, and its digest.
//!
//! YAML is read with [`serde_norway`]: a maintained fork of `serde_yaml` (which its author
//! archived in 2024) with the same API, built on `unsafe-libyaml-norway`, a maintained fork
//! of the libyaml port. `serde_yaml_ng` was the other candidate; its 0.10 still depends on
//! the archived `unsafe-libyaml`. Both read YAML 1.2 core schema scalars, so `no` or `on`
//! stay strings.

use std::path::Path;

use aether_ledger::hashing::{Hash, canonical_json, sm3};
use serde::{Deserialize, Serialize};

use crate::error::PolicyError;

/// Longest policy name accepted (names become stream ids `policy/{name}` and hook names).
pub const MAX_POLICY_NAME_BYTES: usize = 128;
/// Most rules one policy may hold.
pub const MAX_RULES_PER_POLICY: usize = 1_000;

/// What a rule asks for when it fires. Ordered from the most lenient to the strictest, so
/// the decision of an evaluation is the maximum.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    Allow,
    Hold,
    Deny,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Allow => "allow",
            Action::Hold => "hold",
            Action::Deny => "deny",
        }
    }
}

/// How serious a fired rule is, for reviewers and reports. It does not change the decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Low,
    Medium,
    High,
    Critical,
}

/// One rule of a policy, as written.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleSpec {
    /// Unique within the policy.
    pub id: String,
    /// CEL over `request` and `context`; must evaluate to a bool. `true` means the rule fires.
    pub expression: String,
    pub action: Action,
    pub severity: Severity,
    /// Ids of the regulatory clauses this rule implements (e.g. `rep-threshold-1`).
    #[serde(default)]
    pub cites: Vec<String>,
}

/// A policy document, as written. Unknown fields are rejected, so a misspelt field is an
/// error rather than silently ignored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyDocument {
    pub name: String,
    /// `MAJOR.MINOR.PATCH`, e.g. `"2.0.0"`.
    pub version: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    pub rules: Vec<RuleSpec>,
}

/// The text format of a policy document.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyFormat {
    Json,
    Yaml,
}

impl PolicyFormat {
    /// The format a file name implies: `.json`, or `.yaml` / `.yml` (any case).
    pub fn from_path(path: &Path) -> Option<PolicyFormat> {
        let ext = path.extension()?.to_str()?.to_ascii_lowercase();
        match ext.as_str() {
            "json" => Some(PolicyFormat::Json),
            "yaml" | "yml" => Some(PolicyFormat::Yaml),
            _ => None,
        }
    }
}

impl PolicyDocument {
    /// Parses a JSON policy document. Checks its shape only; see [`crate::CompiledPolicy`]
    /// for everything else.
    pub fn from_json(text: &str) -> Result<PolicyDocument, PolicyError> {
        serde_json::from_str(text).map_err(|e| PolicyError::Json {
            message: e.to_string(),
        })
    }

    /// Parses a YAML policy document. Checks its shape only.
    pub fn from_yaml(text: &str) -> Result<PolicyDocument, PolicyError> {
        serde_norway::from_str(text).map_err(|e| PolicyError::Yaml {
            message: e.to_string(),
        })
    }

    /// Parses a policy document in the given format.
    pub fn parse(text: &str, format: PolicyFormat) -> Result<PolicyDocument, PolicyError> {
        match format {
            PolicyFormat::Json => Self::from_json(text),
            PolicyFormat::Yaml => Self::from_yaml(text),
        }
    }

    /// Reads and parses a policy file; the format comes from the file's extension.
    pub fn read(path: &Path) -> Result<PolicyDocument, PolicyError> {
        let format = PolicyFormat::from_path(path).ok_or_else(|| PolicyError::UnknownFormat {
            path: path.display().to_string(),
        })?;
        let text = std::fs::read_to_string(path).map_err(|e| PolicyError::Read {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Self::parse(&text, format)
    }

    /// The policy as a JSON value: fields as in the document, `description` omitted when
    /// absent, `cites` always present. This is what the digest covers.
    pub fn to_json_value(&self) -> Result<serde_json::Value, PolicyError> {
        serde_json::to_value(self).map_err(|e| PolicyError::Canonicalization {
            name: self.name.clone(),
            message: e.to_string(),
        })
    }

    /// RFC 8785 (JCS) text of [`Self::to_json_value`]: the same for the same policy
    /// whether it was written in JSON or YAML and whatever the order of its keys.
    pub fn canonical_json(&self) -> Result<String, PolicyError> {
        canonical_json(&self.to_json_value()?).map_err(|e| PolicyError::Canonicalization {
            name: self.name.clone(),
            message: e.to_string(),
        })
    }

    /// SM3 of [`Self::canonical_json`].
    pub fn digest(&self) -> Result<Hash, PolicyError> {
        Ok(sm3(self.canonical_json()?.as_bytes()))
    }

    /// Checks that need no CEL: name, version, rule count, rule ids, cites.
    pub(crate) fn check_outline(&self) -> Result<(), PolicyError> {
        check_name(&self.name)?;
        if !is_valid_version(&self.version) {
            return Err(PolicyError::InvalidVersion {
                name: self.name.clone(),
                version: self.version.clone(),
            });
        }
        if self.rules.is_empty() {
            return Err(PolicyError::NoRules {
                name: self.name.clone(),
            });
        }
        if self.rules.len() > MAX_RULES_PER_POLICY {
            return Err(PolicyError::TooManyRules {
                name: self.name.clone(),
                count: self.rules.len(),
                max: MAX_RULES_PER_POLICY,
            });
        }
        let mut seen: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        for (i, rule) in self.rules.iter().enumerate() {
            let index = i + 1;
            if rule.id.trim().is_empty() {
                return Err(PolicyError::EmptyRuleId {
                    name: self.name.clone(),
                    index,
                });
            }
            if let Some(&first) = seen.get(rule.id.as_str()) {
                return Err(PolicyError::DuplicateRuleId {
                    name: self.name.clone(),
                    rule_id: rule.id.clone(),
                    first,
                    second: index,
                });
            }
            seen.insert(&rule.id, index);
            if rule.cites.iter().any(|c| c.trim().is_empty()) {
                return Err(PolicyError::EmptyCite {
                    rule_id: rule.id.clone(),
                });
            }
        }
        Ok(())
    }
}

fn check_name(name: &str) -> Result<(), PolicyError> {
    if name.is_empty() {
        return Err(PolicyError::EmptyName);
    }
    let starts_well = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric());
    let chars_ok = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if !starts_well || !chars_ok || name.len() > MAX_POLICY_NAME_BYTES {
        return Err(PolicyError::InvalidName {
            name: name.to_string(),
            max: MAX_POLICY_NAME_BYTES,
        });
    }
    Ok(())
}

/// `MAJOR.MINOR.PATCH`: three decimal numbers that fit a u64, no leading zeros.
fn is_valid_version(version: &str) -> bool {
    let parts: Vec<&str> = version.split('.').collect();
    parts.len() == 3
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.bytes().all(|b| b.is_ascii_digit())
                && (p.len() == 1 || !p.starts_with('0'))
                && p.parse::<u64>().is_ok()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions() {
        for ok in ["0.0.0", "1.2.3", "10.0.1"] {
            assert!(is_valid_version(ok), "{ok}");
        }
        for bad in [
            "",
            "1",
            "1.2",
            "1.2.3.4",
            "01.2.3",
            "1.2.x",
            "v1.2.3",
            "1..3",
            " 1.2.3",
            "1.2.3-rc1",
            "99999999999999999999.0.0",
        ] {
            assert!(!is_valid_version(bad), "{bad}");
        }
    }

    #[test]
    fn yaml_plain_scalars_like_no_stay_strings() {
        let doc = PolicyDocument::from_yaml(
            "name: p\nversion: 1.0.0\nrules:\n  - id: on\n    expression: 'true'\n    action: hold\n    severity: low\n    cites: [no, yes, off]\n",
        )
        .expect("parses");
        assert_eq!(doc.rules[0].id, "on");
        assert_eq!(doc.rules[0].cites, ["no", "yes", "off"]);
    }

    #[test]
    fn names() {
        assert!(check_name("aml_v2").is_ok());
        assert!(check_name("basel3-delta.eu").is_ok());
        assert_eq!(check_name(""), Err(PolicyError::EmptyName));
        for bad in ["_x", "a b", "a/b", "é", &"a".repeat(129)] {
            assert!(
                matches!(check_name(bad), Err(PolicyError::InvalidName { .. })),
                "{bad}"
            );
        }
    }
}
