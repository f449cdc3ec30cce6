//! Bearer tokens with roles. Tokens come from `AETHER_TOKENS` (`role:token,…`), a file named
//! by `AETHER_TOKENS_FILE`, or `<data>/tokens`, created on first start with mode 0600.
//! Only SM3 digests of tokens are kept in memory, and tokens are never logged.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rand::RngExt;

/// Why tokens cannot be read or made.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("unknown role {0:?}: expected operator, regulator or worker")]
    UnknownRole(String),
    #[error("token entry {0} is not role:token")]
    NotRoleToken(usize),
    #[error("token entry {entry} ({role:?}) is shorter than 16 characters")]
    TooShort { entry: usize, role: Role },
    #[error("no tokens configured")]
    NoTokens,
    /// A parse error, with where the tokens came from.
    #[error("{from}: {error}")]
    In {
        from: String,
        error: Box<TokenError>,
    },
    #[error("cannot read tokens file {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("cannot create tokens file {path}: {error}")]
    Create { path: String, error: std::io::Error },
}

impl TokenError {
    fn from_source(from: impl Into<String>) -> impl FnOnce(TokenError) -> TokenError {
        let from = from.into();
        move |error| TokenError::In {
            from,
            error: Box::new(error),
        }
    }
}

/// What a caller may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Changes the engine; appends.
    Operator,
    /// Reads everything, changes nothing.
    Regulator,
    /// Reports from clearing workers.
    Worker,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Operator => "operator",
            Role::Regulator => "regulator",
            Role::Worker => "worker",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = TokenError;
    fn from_str(s: &str) -> Result<Role, TokenError> {
        match s {
            "operator" => Ok(Role::Operator),
            "regulator" => Ok(Role::Regulator),
            "worker" => Ok(Role::Worker),
            other => Err(TokenError::UnknownRole(other.to_owned())),
        }
    }
}

/// An authenticated caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub role: Role,
    /// `role:fingerprint`, as recorded in event metadata.
    pub actor: String,
}

/// Where the tokens came from, for the start-up message.
#[derive(Debug)]
pub enum TokenSource {
    Environment,
    File(PathBuf),
    Created(PathBuf),
}

#[derive(Clone, Default)]
pub struct Tokens {
    by_digest: HashMap<[u8; 32], Role>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokens({} configured)", self.by_digest.len())
    }
}

fn digest(token: &str) -> [u8; 32] {
    aether_ledger::hashing::sm3(token.as_bytes())
}

impl Tokens {
    /// Parses `role:token` pairs separated by commas or newlines; `#` starts a comment line.
    pub fn parse(spec: &str) -> Result<Tokens, TokenError> {
        let mut by_digest = HashMap::new();
        for (i, item) in spec
            .split([',', '\n'])
            .map(str::trim)
            .filter(|s| !s.is_empty() && !s.starts_with('#'))
            .enumerate()
        {
            let (role, token) = item
                .split_once(':')
                .ok_or(TokenError::NotRoleToken(i + 1))?;
            let role: Role = role.trim().parse()?;
            let token = token.trim();
            if token.len() < 16 {
                return Err(TokenError::TooShort { entry: i + 1, role });
            }
            by_digest.insert(digest(token), role);
        }
        if by_digest.is_empty() {
            return Err(TokenError::NoTokens);
        }
        Ok(Tokens { by_digest })
    }

    /// Tokens from the environment, a named file, or `<data_dir>/tokens` (created if absent).
    pub fn load(data_dir: &Path) -> Result<(Tokens, TokenSource), TokenError> {
        if let Ok(spec) = std::env::var("AETHER_TOKENS")
            && !spec.trim().is_empty()
        {
            return Ok((
                Tokens::parse(&spec).map_err(TokenError::from_source("AETHER_TOKENS"))?,
                TokenSource::Environment,
            ));
        }
        let (path, named) = match std::env::var_os("AETHER_TOKENS_FILE") {
            Some(p) => (PathBuf::from(p), true),
            None => (data_dir.join("tokens"), false),
        };
        if path.exists() || named {
            let spec = std::fs::read_to_string(&path).map_err(|error| TokenError::Read {
                path: path.display().to_string(),
                error,
            })?;
            let tokens = Tokens::parse(&spec)
                .map_err(TokenError::from_source(path.display().to_string()))?;
            return Ok((tokens, TokenSource::File(path)));
        }
        let mut spec = String::from("# Aether API tokens: role:token. Keep this file private.\n");
        for role in ["operator", "regulator", "worker"] {
            spec.push_str(&format!("{role}:{}\n", random_token()));
        }
        write_private(&path, &spec)?;
        Ok((Tokens::parse(&spec)?, TokenSource::Created(path)))
    }

    /// Who presents `token`: its role and a fingerprint that names the token in the
    /// ledger's access records without revealing it.
    pub fn caller(&self, token: &str) -> Option<Caller> {
        let d = digest(token);
        self.by_digest.get(&d).map(|&role| Caller {
            role,
            actor: format!("{}:{}", role.name(), hex::encode(&d[..4])),
        })
    }
}

fn random_token() -> String {
    let bytes: [u8; 24] = rand::rng().random();
    hex::encode(bytes)
}

fn write_private(path: &Path, contents: &str) -> Result<(), TokenError> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let create = |error| TokenError::Create {
        path: path.display().to_string(),
        error,
    };
    let mut f = options.open(path).map_err(create)?;
    f.write_all(contents.as_bytes()).map_err(create)?;
    f.sync_all().map_err(create)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_roles_and_rejects_bad_entries() {
        let t = Tokens::parse("operator:aaaaaaaaaaaaaaaa, regulator:bbbbbbbbbbbbbbbb").unwrap();
        assert_eq!(
            t.caller("aaaaaaaaaaaaaaaa").map(|c| c.role),
            Some(Role::Operator)
        );
        assert_eq!(
            t.caller("bbbbbbbbbbbbbbbb").map(|c| c.role),
            Some(Role::Regulator)
        );
        assert_eq!(t.caller("cccccccccccccccc"), None);
        assert!(Tokens::parse("admin:aaaaaaaaaaaaaaaa").is_err());
        assert!(Tokens::parse("operator:short").is_err());
        assert!(Tokens::parse("operator").is_err());
        assert!(Tokens::parse("").is_err());
    }

    #[test]
    fn a_created_tokens_file_is_private_and_reloads() {
        let dir = tempfile::tempdir().unwrap();
        let (a, source) = Tokens::load(dir.path()).unwrap();
        assert!(matches!(source, TokenSource::Created(_)));
        let (b, source) = Tokens::load(dir.path()).unwrap();
        assert!(matches!(source, TokenSource::File(_)));
        assert_eq!(a.by_digest, b.by_digest);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join("tokens"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }
}
