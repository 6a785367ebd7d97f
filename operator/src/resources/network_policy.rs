//! `<job>-isolation`: the NetworkPolicy of a job with spec.networkPolicy.enabled. It selects
//! every pod of the job and admits to them only the job's own pods (ssh to the workers, and the
//! connections MPI and NCCL open both ways on ports chosen at run time), the operator's pods on
//! rank 0's progress port, and the rules in spec.networkPolicy.ingress. Egress stays open (data
//! sources, registries). Only a network plugin that implements NetworkPolicy enforces it.

use super::{child_meta, job_labels, names};
use crate::crd::TrainingJob;
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use std::collections::BTreeMap;

/// The operator's own pods, which read rank 0's progress: their namespace and the labels that
/// select them (the chart passes both).
#[derive(Clone, Debug, PartialEq)]
pub struct OperatorPods {
    pub namespace: String,
    pub labels: BTreeMap<String, String>,
}

impl OperatorPods {
    /// From the namespace and a selector written `key=value,key=value`, checked as the API
    /// server checks labels (else every policy would be refused, job after job).
    pub fn parse(namespace: &str, selector: &str) -> Result<Self, String> {
        let labels = selector
            .split(',')
            .filter(|pair| !pair.trim().is_empty())
            .map(|pair| match pair.split_once('=') {
                Some((k, v)) if label_key(k.trim()) && (v.trim().is_empty() || label_name(v.trim())) => {
                    Ok((k.trim().to_string(), v.trim().to_string()))
                }
                _ => Err(format!("'{pair}' is not a label key=value")),
            })
            .collect::<Result<BTreeMap<_, _>, _>>()?;
        if labels.is_empty() {
            return Err("no labels: the operator's pods would be every pod of its namespace".into());
        }
        Ok(Self { namespace: namespace.to_string(), labels })
    }
}

/// A label's name or value: at most 63 characters, alphanumerics with `-`, `_` or `.` between.
fn label_name(s: &str) -> bool {
    let inner = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
    let ends = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    s.len() <= 63 && ends(s.chars().next()) && ends(s.chars().last()) && s.chars().all(inner)
}

/// A label key: a name, after an optional DNS-subdomain prefix and `/`.
fn label_key(s: &str) -> bool {
    match s.split_once('/') {
        Some((prefix, name)) => {
            prefix.len() <= 253
                && prefix
                    .split('.')
                    .all(|part| label_name(part) && !part.contains('_') && part == part.to_ascii_lowercase())
                && label_name(name)
        }
        None => label_name(s),
    }
}

/// The job's NetworkPolicy, or `None` when spec.networkPolicy.enabled is false. Without
/// `operator` (an operator running outside the cluster) no rule admits the progress reads.
pub fn network_policy(job: &TrainingJob, operator: Option<&OperatorPods>) -> Option<NetworkPolicy> {
    let spec = &job.spec.network_policy;
    if !spec.enabled {
        return None;
    }
    let selector =
        |labels: BTreeMap<String, String>| LabelSelector { match_labels: Some(labels), ..Default::default() };
    let own_pods = NetworkPolicyPeer { pod_selector: Some(selector(job_labels(job))), ..Default::default() };
    let mut ingress = vec![NetworkPolicyIngressRule { from: Some(vec![own_pods]), ports: None }];
    if let Some(operator) = operator {
        let namespace = BTreeMap::from([("kubernetes.io/metadata.name".to_string(), operator.namespace.clone())]);
        let peer = NetworkPolicyPeer {
            namespace_selector: Some(selector(namespace)),
            pod_selector: Some(selector(operator.labels.clone())),
            ..Default::default()
        };
        let port = NetworkPolicyPort {
            port: Some(IntOrString::Int(job.spec.progress_port)),
            protocol: Some("TCP".into()),
            ..Default::default()
        };
        ingress.push(NetworkPolicyIngressRule { from: Some(vec![peer]), ports: Some(vec![port]) });
    }
    ingress.extend(spec.ingress.iter().cloned());
    Some(NetworkPolicy {
        metadata: child_meta(job, names::network_policy(job)),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(selector(job_labels(job))),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(ingress),
            egress: None,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::tests::job;

    #[test]
    fn only_the_jobs_pods_and_the_operators_progress_reads_are_admitted() {
        let mut j = job("llm", 2);
        assert!(network_policy(&j, None).is_none(), "off unless enabled");
        j.spec.network_policy.enabled = true;
        let operator = OperatorPods::parse("tensorfleet-system", "app.kubernetes.io/component=operator,app=x").unwrap();
        let policy = network_policy(&j, Some(&operator)).unwrap();
        assert_eq!(policy.metadata.name.as_deref(), Some("llm-isolation"));
        let spec = policy.spec.unwrap();
        let own = spec.pod_selector.unwrap().match_labels.unwrap();
        assert_eq!(own["tensorfleet.dev/job-name"], "llm");
        assert_eq!(spec.policy_types.unwrap(), ["Ingress"]);
        let ingress = spec.ingress.unwrap();
        assert_eq!(ingress.len(), 2);
        // The job's pods reach each other on every port (MPI and NCCL choose theirs at run time).
        let from = &ingress[0].from.as_ref().unwrap()[0];
        assert_eq!(from.pod_selector.as_ref().unwrap().match_labels.as_ref().unwrap(), &own);
        assert!(from.namespace_selector.is_none() && ingress[0].ports.is_none());
        // The operator's pods, in its namespace only, reach the progress port only.
        let from = &ingress[1].from.as_ref().unwrap()[0];
        let ns = from.namespace_selector.as_ref().unwrap().match_labels.as_ref().unwrap();
        assert_eq!(ns["kubernetes.io/metadata.name"], "tensorfleet-system");
        assert_eq!(from.pod_selector.as_ref().unwrap().match_labels.as_ref().unwrap()["app"], "x");
        assert_eq!(ingress[1].ports.as_ref().unwrap()[0].port, Some(IntOrString::Int(9400)));
        // The user's own rules come after.
        j.spec.network_policy.ingress = vec![NetworkPolicyIngressRule::default()];
        assert_eq!(network_policy(&j, None).unwrap().spec.unwrap().ingress.unwrap().len(), 2);
    }

    #[test]
    fn an_operator_selector_must_be_labels() {
        assert!(OperatorPods::parse("ns", "").is_err());
        assert!(OperatorPods::parse("ns", "app").unwrap_err().contains("'app'"));
        assert!(OperatorPods::parse("ns", "a=1=2").is_err());
        assert!(OperatorPods::parse("ns", "-a=1").is_err());
        assert!(OperatorPods::parse("ns", "app.kubernetes.io/name=tensorfleet,tier=").is_ok());
        assert_eq!(OperatorPods::parse("ns", "a=1, b=2").unwrap().labels.len(), 2);
    }
}
