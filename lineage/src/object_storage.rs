//! Delta tables on S3-compatible object storage (`s3://bucket/prefix`), through
//! `object_store`'s S3 client, without deltalake's AWS crate (its DynamoDB lock client and
//! the AWS SDK are not needed once the store has conditional puts).
//!
//! Why a second writer is safe: a Delta commit is the object `_delta_log/<version>.json`,
//! written with `If-None-Match: *`, so of two writers that try the same version exactly one
//! succeeds; the loser's retry finds that the winning commit carries the same application
//! transaction id and gives up (a conflict, never a duplicate row). A store that cannot do
//! conditional puts (`AWS_CONDITIONAL_PUT=disabled`) is refused rather than trusted.
//!
//! Settings are the usual `AWS_*` environment variables that `object_store` reads
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT`,
//! `AWS_ALLOW_HTTP`, ...).

use std::sync::{Arc, Once};

use deltalake::logstore::{
    LogStore, LogStoreFactory, ObjectStoreFactory, ObjectStoreRef, StorageConfig, default_logstore,
    logstore_factories, object_store_factories,
};
use deltalake::{DeltaResult, DeltaTableError};
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as StorePath;
use url::Url;

/// The URL schemes served here.
const SCHEMES: [&str; 2] = ["s3://", "s3a://"];

/// Makes `s3://` (and `s3a://`) table locations openable. Idempotent.
pub fn register() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for scheme in SCHEMES {
            let Ok(url) = Url::parse(scheme) else {
                continue;
            };
            object_store_factories().insert(url.clone(), Arc::new(S3Stores));
            logstore_factories().insert(url, Arc::new(PutIfAbsentLogs));
        }
    });
}

/// Whether `location` names a table on object storage rather than a local directory.
pub fn is_object_store(location: &str) -> bool {
    SCHEMES.iter().any(|s| location.starts_with(s))
}

struct S3Stores;

impl ObjectStoreFactory for S3Stores {
    fn parse_url_opts(
        &self,
        url: &Url,
        config: &StorageConfig,
    ) -> DeltaResult<(ObjectStoreRef, StorePath)> {
        let mut builder = AmazonS3Builder::from_env().with_url(url.as_str());
        for (key, value) in &config.raw {
            if let Ok(key) = key.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() {
                builder = builder.with_config(key, value);
            }
        }
        if builder
            .get_config_value(&AmazonS3ConfigKey::ConditionalPut)
            .is_some_and(|v| v == "disabled")
        {
            return Err(DeltaTableError::InvalidTableLocation(format!(
                "{url}: conditional puts are disabled (AWS_CONDITIONAL_PUT=disabled); Aether \
                 writes Delta commits only where a second writer's commit is refused by the store"
            )));
        }
        let store = builder
            .build()
            .map_err(|e| DeltaTableError::InvalidTableLocation(format!("{url}: {e}")))?;
        let path = StorePath::from_url_path(url.path())
            .map_err(|e| DeltaTableError::InvalidTableLocation(format!("{url}: {e}")))?;
        Ok((Arc::new(store), path))
    }
}

/// deltalake's own log store: each commit put with `PutMode::Create`.
struct PutIfAbsentLogs;

impl LogStoreFactory for PutIfAbsentLogs {
    fn with_options(
        &self,
        prefixed_store: ObjectStoreRef,
        root_store: ObjectStoreRef,
        location: &Url,
        options: &StorageConfig,
    ) -> DeltaResult<Arc<dyn LogStore>> {
        Ok(default_logstore(
            prefixed_store,
            root_store,
            location,
            options,
        ))
    }
}
