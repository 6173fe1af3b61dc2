//! TLS for the input service, where the user gives certificates. The token
//! ([`crate::auth`]) says who may call; TLS keeps the token and the data off
//! the wire in the clear when the service leaves loopback.
//!
//! One rule for every process of a deployment: TLS is on when the
//! authority that signed the service's certificates is given
//! (`$HINDSIGHT_DATA_TLS_CA`, PEM). Every process then verifies its peers
//! against it and dials `https://`. A process that serves (a dispatcher, a
//! worker) also needs its own certificate and key
//! (`$HINDSIGHT_DATA_TLS_CERT`, `$HINDSIGHT_DATA_TLS_KEY`, PEM), issued for
//! the name or address others dial. A half-given setting is an error naming
//! the missing variable, never a silent fall back to plain text.

use std::path::Path;

use hindsight_core::settings;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig};

use crate::error::{Error, Result};

/// How this process talks to the service: in the clear (loopback, the
/// default) or over TLS.
#[derive(Debug, Clone, Default)]
pub struct Tls {
    /// The authority peers' certificates must chain to; None: TLS is off.
    ca: Option<Certificate>,
    /// This process's certificate and key, for serving.
    identity: Option<Identity>,
}

/// Make ring this process's TLS provider, unless one was chosen already. A
/// binary that links two (the S3 store brings aws-lc-rs) has no default, and
/// rustls panics where tonic builds a server's configuration.
fn provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        what: format!("read the {what} {}", path.display()),
        source,
    })?;
    if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(Error::Tls(format!(
            "{} (the {what}) is not PEM: no '-----BEGIN' line",
            path.display()
        )));
    }
    Ok(bytes)
}

impl Tls {
    /// Plain text: for loopback and tests.
    pub fn off() -> Tls {
        Tls::default()
    }

    /// TLS from PEM files: `ca` turns it on; `cert` and `key` (both or
    /// neither) let this process serve. `names` are the settings the paths
    /// came from, for errors: (ca, cert, key).
    pub fn from_files(
        ca: Option<&Path>,
        cert: Option<&Path>,
        key: Option<&Path>,
        names: (&str, &str, &str),
    ) -> Result<Tls> {
        let identity = match (cert, key) {
            (None, None) => None,
            (Some(c), Some(k)) => Some(Identity::from_pem(
                read(c, "service certificate")?,
                read(k, "service key")?,
            )),
            (Some(_), None) => {
                return Err(Error::Tls(format!(
                    "{} is set but {} is not: a certificate serves only with its key",
                    names.1, names.2
                )))
            }
            (None, Some(_)) => {
                return Err(Error::Tls(format!(
                    "{} is set but {} is not: a key serves only with its certificate",
                    names.2, names.1
                )))
            }
        };
        let Some(ca) = ca else {
            if identity.is_some() {
                return Err(Error::Tls(format!(
                    "{} and {} are set but {} is not: give the authority that signed the \
                     service's certificates, with which every process verifies its peers",
                    names.1, names.2, names.0
                )));
            }
            return Ok(Tls::off());
        };
        Ok(Tls {
            ca: Some(Certificate::from_pem(read(ca, "certificate authority")?)),
            identity,
        })
    }

    /// From `$HINDSIGHT_DATA_TLS_CA`, `_CERT` and `_KEY`.
    pub fn from_env() -> Result<Tls> {
        let path = |s: &settings::Setting| -> Result<Option<std::path::PathBuf>> {
            match s.get().map_err(|e| Error::Tls(e.to_string()))? {
                Some(settings::Value::Text(t)) => Ok(Some(t.into())),
                _ => Ok(None),
            }
        };
        let (ca, cert, key) = (
            path(&settings::DATA_TLS_CA)?,
            path(&settings::DATA_TLS_CERT)?,
            path(&settings::DATA_TLS_KEY)?,
        );
        Tls::from_files(
            ca.as_deref(),
            cert.as_deref(),
            key.as_deref(),
            (
                settings::DATA_TLS_CA.name,
                settings::DATA_TLS_CERT.name,
                settings::DATA_TLS_KEY.name,
            ),
        )
    }

    /// `given`, else [`Tls::from_env`].
    pub fn resolve(given: Option<Tls>) -> Result<Tls> {
        match given {
            Some(t) => Ok(t),
            None => Tls::from_env(),
        }
    }

    /// Whether connections are encrypted.
    pub fn on(&self) -> bool {
        self.ca.is_some()
    }

    /// A server builder that serves over TLS when it is on; `role` names
    /// the server in the error when it has no certificate.
    pub(crate) fn server(&self, builder: Server, role: &str) -> Result<Server> {
        if self.ca.is_none() {
            return Ok(builder);
        }
        provider();
        let Some(identity) = self.identity.clone() else {
            return Err(Error::Tls(format!(
                "a {role} serves over TLS ({} is set) but has no certificate: set {} and {}",
                settings::DATA_TLS_CA.name,
                settings::DATA_TLS_CERT.name,
                settings::DATA_TLS_KEY.name
            )));
        };
        builder
            .tls_config(ServerTlsConfig::new().identity(identity))
            .map_err(|e| Error::Tls(format!("the {role}'s certificate or key: {e}")))
    }

    /// The URI for `addr` ("host:port", or a URI as given).
    pub(crate) fn uri(&self, addr: &str) -> String {
        if addr.contains("://") {
            addr.to_string()
        } else if self.on() {
            format!("https://{addr}")
        } else {
            format!("http://{addr}")
        }
    }

    /// `ep` verifying its peer against the authority when TLS is on.
    pub(crate) fn client(
        &self,
        ep: Endpoint,
    ) -> std::result::Result<Endpoint, tonic::transport::Error> {
        match &self.ca {
            Some(ca) => {
                provider();
                ep.tls_config(ClientTlsConfig::new().ca_certificate(ca.clone()))
            }
            None => Ok(ep),
        }
    }
}
