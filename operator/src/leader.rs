//! Leader election on a `coordination.k8s.io/v1` Lease, the way client-go's leaderelection
//! does it: take the Lease when it is free or expired, renew it well inside its duration, and
//! stop leading (the process exits) when a renewal fails for longer than the Lease lasts.
//!
//! Written here rather than taken from a crate: kube-lease-manager 0.13 (the one on kube 5) keeps
//! reporting leadership while its renewals fail, past the Lease's expiry (its watch loop logs
//! the error, sleeps and retries), so a replica cut off from the API server would go on
//! reconciling while another takes the Lease; client-go steps down at its renew deadline, as
//! `hold` does. kube-leader-election needs kube 4.

use crate::status::now;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use std::time::Duration;

pub struct LeaderElection {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
}

impl LeaderElection {
    pub fn new(client: kube::Client, namespace: &str, name: &str, identity: &str, duration: Duration) -> Self {
        LeaderElection {
            api: Api::namespaced(client, namespace),
            name: name.into(),
            identity: identity.into(),
            duration,
        }
    }

    /// Waits until this replica holds the Lease.
    pub async fn acquire(&self) {
        let mut logged = false;
        loop {
            match self.try_acquire_or_renew().await {
                Ok(true) => {
                    tracing::info!(lease = %self.name, identity = %self.identity, "became the leader");
                    return;
                }
                Ok(false) if !logged => {
                    tracing::info!(lease = %self.name, "another replica leads; waiting as a standby");
                    logged = true;
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(lease = %self.name, "leader election: {e}"),
            }
            tokio::time::sleep(self.duration / 4).await;
        }
    }

    /// Renews the Lease until it is lost; returns when this replica must stop leading.
    pub async fn hold(&self) {
        let mut last_renewal = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(self.duration / 3).await;
            match self.try_acquire_or_renew().await {
                Ok(true) => last_renewal = tokio::time::Instant::now(),
                Ok(false) => {
                    tracing::error!(lease = %self.name, "another replica took the Lease");
                    return;
                }
                Err(e) => {
                    tracing::warn!(lease = %self.name, "renewing the Lease: {e}");
                    if last_renewal.elapsed() >= self.duration {
                        tracing::error!(lease = %self.name, "could not renew within the Lease duration");
                        return;
                    }
                }
            }
        }
    }

    /// Gives the Lease up on shutdown, so a standby takes over at once instead of waiting it out.
    pub async fn release(&self) {
        if let Ok(mut lease) = self.api.get(&self.name).await {
            let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
            if spec.holder_identity.as_deref() == Some(self.identity.as_str()) {
                spec.holder_identity = None;
                spec.lease_duration_seconds = Some(1);
                let _ = self.api.replace(&self.name, &PostParams::default(), &lease).await;
            }
        }
    }

    /// One round: true when we hold the Lease afterwards. Updates carry the resourceVersion we
    /// read, so two replicas can never both win the same round.
    async fn try_acquire_or_renew(&self) -> Result<bool, kube::Error> {
        let time = MicroTime(now().0);
        let seconds = self.duration.as_secs().max(1) as i32;
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(self.name.clone()), ..ObjectMeta::default() },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(seconds),
                    acquire_time: Some(time.clone()),
                    renew_time: Some(time),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        let ours = spec.holder_identity.as_deref() == Some(self.identity.as_str());
        let free = spec.holder_identity.as_deref().is_none_or(str::is_empty);
        let expired = match (&spec.renew_time, spec.lease_duration_seconds) {
            (Some(renewed), Some(d)) => time.0.duration_since(renewed.0).as_secs_f64() > f64::from(d),
            _ => true,
        };
        if !(ours || free || expired) {
            return Ok(false);
        }
        if !ours {
            spec.holder_identity = Some(self.identity.clone());
            spec.acquire_time = Some(time.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.lease_duration_seconds = Some(seconds);
        spec.renew_time = Some(time);
        match self.api.replace(&self.name, &PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }
}
