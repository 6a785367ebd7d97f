//! Gang scheduling: a PodGroup of Volcano (`scheduling.volcano.sh/v1beta1`) or of the
//! scheduler-plugins coscheduling plugin (`scheduling.x-k8s.io/v1alpha1`), sized to the pods
//! that exist, so the scheduler places the whole gang or none of it.

use super::{child_meta, names};
use crate::crd::{GangScheduler, TrainingJob};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use serde_json::json;
use std::collections::BTreeMap;

/// The PodGroup's API resource for the configured gang scheduler.
pub fn api_resource(gang: GangScheduler) -> Option<ApiResource> {
    let gvk = match gang {
        GangScheduler::None => return None,
        GangScheduler::Volcano => GroupVersionKind::gvk("scheduling.volcano.sh", "v1beta1", "PodGroup"),
        GangScheduler::SchedulerPlugins => GroupVersionKind::gvk("scheduling.x-k8s.io", "v1alpha1", "PodGroup"),
    };
    Some(ApiResource::from_gvk_with_plural(&gvk, "podgroups"))
}

/// The PodGroup for `members` pods (the workers, plus the launcher once it exists).
pub fn pod_group(job: &TrainingJob, members: i32) -> Option<DynamicObject> {
    let resource = api_resource(job.spec.scheduling.gang)?;
    let scheduling = &job.spec.scheduling;
    let mut spec = json!({ "minMember": members });
    match scheduling.gang {
        GangScheduler::Volcano => {
            if let Some(q) = &scheduling.queue {
                spec["queue"] = json!(q);
            }
            if let Some(p) = &scheduling.priority_class_name {
                spec["priorityClassName"] = json!(p);
            }
        }
        GangScheduler::SchedulerPlugins => {
            if let Some(t) = scheduling.schedule_timeout_seconds {
                spec["scheduleTimeoutSeconds"] = json!(t);
            }
        }
        GangScheduler::None => {}
    }
    let mut group = DynamicObject::new(&names::pod_group(job), &resource).within(&names::namespace(job));
    group.metadata = child_meta(job, names::pod_group(job));
    group.data = json!({ "spec": spec });
    Some(group)
}

/// Marks a pod as a member of the job's PodGroup, the way its scheduler looks for it.
pub fn mark_member(
    job: &TrainingJob,
    labels: &mut BTreeMap<String, String>,
    annotations: &mut BTreeMap<String, String>,
) {
    match job.spec.scheduling.gang {
        GangScheduler::None => {}
        GangScheduler::Volcano => {
            annotations.insert("scheduling.k8s.io/group-name".into(), names::pod_group(job));
        }
        GangScheduler::SchedulerPlugins => {
            labels.insert("scheduling.x-k8s.io/pod-group".into(), names::pod_group(job));
        }
    }
}

/// The scheduler that places the pods: the user's choice, else the gang scheduler's.
pub fn scheduler_name(job: &TrainingJob) -> Option<String> {
    let scheduling = &job.spec.scheduling;
    scheduling.scheduler_name.clone().or_else(|| match scheduling.gang {
        GangScheduler::None => None,
        GangScheduler::Volcano => Some("volcano".into()),
        GangScheduler::SchedulerPlugins => Some("scheduler-plugins-scheduler".into()),
    })
}
