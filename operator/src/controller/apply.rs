//! Carries out a plan of `decide` through the API, step by step in its order.

use super::decide::{self, Deletion, Next, Note, Plan, Step};
use super::Context;
use crate::crd::{JobPhase, TrainingJob, TrainingJobStatus};
use crate::resources::{self, names, FIELD_MANAGER};
use crate::status;
use crate::{Error, Result};
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, PropagationPolicy};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use serde_json::json;

/// Runs `plan`'s steps; a pod the API server refuses (an admission rule, a missing
/// PriorityClass, a quota) ends it early with `decide::refused`'s plan instead.
pub async fn apply(job: &TrainingJob, ctx: &Context, plan: Plan) -> Result<Action> {
    let plan = match run(job, ctx, &plan).await? {
        Refusal::None => plan,
        Refusal::Refused { message, not_created } => {
            let refused = decide::refused(plan, message, not_created, &status::now());
            run(job, ctx, &refused).await?;
            refused
        }
    };
    Ok(match plan.next {
        Next::Requeue(after) => Action::requeue(after),
        Next::AwaitChange => Action::await_change(),
    })
}

enum Refusal {
    None,
    Refused { message: String, not_created: i32 },
}

async fn run(job: &TrainingJob, ctx: &Context, plan: &Plan) -> Result<Refusal> {
    let ns = names::namespace(job);
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    for step in &plan.steps {
        match step {
            Step::ApplyChildren { launcher_exists } => apply_children(job, ctx, *launcher_exists).await?,
            Step::ApplyNetworkPolicy => apply_network_policy(job, ctx).await?,
            Step::DeleteNetworkPolicy => {
                let policies: Api<NetworkPolicy> = Api::namespaced(ctx.client.clone(), &ns);
                ignore_not_found(policies.delete(&names::network_policy(job), &DeleteParams::default()).await)?;
            }
            Step::DeletePods(deletions) => delete_pods(&pods, deletions).await?,
            Step::CreateWorkers(indices) => {
                for (made, i) in indices.iter().enumerate() {
                    let pod = resources::pods::worker(job, *i, plan.status.restart_count);
                    if let Some(message) = refused(create_pod(&pods, pod).await)? {
                        return Ok(Refusal::Refused { message, not_created: (indices.len() - made) as i32 });
                    }
                }
            }
            Step::CreateLauncher => {
                let pod = resources::pods::launcher(job, plan.status.restart_count);
                if let Some(message) = refused(create_pod(&pods, pod).await)? {
                    return Ok(Refusal::Refused { message, not_created: 0 });
                }
            }
            Step::Publish(note) => publish(ctx, job, note).await,
            Step::WriteStatus => write_status(ctx, job, &plan.status).await?,
            Step::CountRestart => ctx.metrics.restarted(),
            Step::DeleteJob => delete_job(job, ctx).await?,
        }
    }
    Ok(Refusal::None)
}

/// The API server's message when it refused a pod (400, 403, 422); other errors go on to
/// error_policy.
fn refused(created: Result<()>) -> Result<Option<String>> {
    match created {
        Ok(()) => Ok(None),
        Err(Error::Kube(kube::Error::Api(status))) if matches!(status.code, 400 | 403 | 422) => {
            Ok(Some(status.message))
        }
        Err(e) => Err(e),
    }
}

/// Server-side applies the ConfigMap, Service, PodGroup; creates the Secret and the claim once.
async fn apply_children(job: &TrainingJob, ctx: &Context, launcher_exists: bool) -> Result<()> {
    let ns = names::namespace(job);
    let client = &ctx.client;
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let config = resources::config::config_map(job).map_err(|e| Error::Build(format!("train.yaml: {e}")))?;
    Api::<ConfigMap>::namespaced(client.clone(), &ns)
        .patch(&names::config_map(job), &pp, &Patch::Apply(&config))
        .await?;
    Api::<Service>::namespaced(client.clone(), &ns)
        .patch(&names::service(job), &pp, &Patch::Apply(&resources::service::service(job)))
        .await?;
    // Keys are made once: re-applying a fresh pair would lock running ranks out of each other.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    if secrets.get_opt(&names::ssh_secret(job)).await?.is_none() {
        let secret = resources::ssh::secret(job).map_err(|e| Error::Build(format!("ssh keys: {e}")))?;
        create_if_absent(&secrets, &secret).await?;
    }
    // Claims are immutable after binding; create once, never resize behind the user's back.
    if let Some(claim) = resources::storage::claim(job) {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
        if claims.get_opt(&names::claim(job)).await?.is_none() {
            create_if_absent(&claims, &claim).await?;
        }
    }
    let members = job.spec.workers + i32::from(launcher_exists);
    if let (Some(group), Some(ar)) =
        (resources::podgroup::pod_group(job, members), resources::podgroup::api_resource(job.spec.scheduling.gang))
    {
        let groups: Api<kube::api::DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ar);
        groups.patch(&names::pod_group(job), &pp, &Patch::Apply(&group)).await.map_err(|e| match e {
            kube::Error::Api(s) if s.code == 404 => Error::Build(format!(
                "PodGroup {}/{} is not served by this cluster: install the gang scheduler or set spec.scheduling.gang: None",
                ar.group, ar.version
            )),
            e => Error::Kube(e),
        })?;
    }
    Ok(())
}

/// The job's NetworkPolicy, admitting this operator's pods to the progress port.
async fn apply_network_policy(job: &TrainingJob, ctx: &Context) -> Result<()> {
    // decide asks for it only while spec.networkPolicy.enabled, when there is one to apply.
    let Some(policy) = resources::network_policy::network_policy(job, ctx.operator_pods.as_ref()) else {
        return Ok(());
    };
    let policies: Api<NetworkPolicy> = Api::namespaced(ctx.client.clone(), &names::namespace(job));
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    policies.patch(&names::network_policy(job), &pp, &Patch::Apply(&policy)).await?;
    Ok(())
}

async fn create_if_absent<K>(api: &Api<K>, object: &K) -> Result<()>
where
    K: Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let pp = PostParams { field_manager: Some(FIELD_MANAGER.into()), ..PostParams::default() };
    match api.create(&pp, object).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Pods are created, not applied: a pod of an old attempt that is still terminating must make
/// this fail (AlreadyExists) rather than be adopted and relabelled as the new one.
async fn create_pod(api: &Api<Pod>, pod: Pod) -> Result<()> {
    let pp = PostParams { field_manager: Some(FIELD_MANAGER.into()), ..PostParams::default() };
    match api.create(&pp, &pod).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            tracing::debug!(pod = ?pod.metadata.name, "exists already (terminating or created by an earlier pass)");
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

async fn delete_pods(api: &Api<Pod>, deletions: &[Deletion]) -> Result<()> {
    for d in deletions {
        let dp = DeleteParams { grace_period_seconds: d.force.then_some(0), ..DeleteParams::default() };
        ignore_not_found(api.delete(&d.pod, &dp).await)?;
    }
    Ok(())
}

/// ttlSecondsAfterFinished has passed: the job goes, its children with it.
async fn delete_job(job: &TrainingJob, ctx: &Context) -> Result<()> {
    let jobs: Api<TrainingJob> = Api::namespaced(ctx.client.clone(), &names::namespace(job));
    let dp = DeleteParams { propagation_policy: Some(PropagationPolicy::Background), ..DeleteParams::default() };
    ignore_not_found(jobs.delete(&job.name_any(), &dp).await)?;
    let ttl = job.spec.run_policy.ttl_seconds_after_finished.unwrap_or_default();
    tracing::info!(job = %job.name_any(), "deleted {ttl} s after it finished (ttlSecondsAfterFinished)");
    Ok(())
}

fn ignore_not_found<T>(result: kube::Result<T>) -> Result<()> {
    match result {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Writes the status with server-side apply, preconditioned on the resourceVersion we read;
/// nothing when it is unchanged.
async fn write_status(ctx: &Context, job: &TrainingJob, st: &TrainingJobStatus) -> Result<()> {
    let old = job.status.clone().unwrap_or_default();
    if *st == old {
        return Ok(());
    }
    let api: Api<TrainingJob> = Api::namespaced(ctx.client.clone(), &names::namespace(job));
    let patch = json!({
        "apiVersion": "tensorfleet.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": { "name": job.name_any(), "resourceVersion": job.resource_version() },
        "status": st,
    });
    api.patch_status(&job.name_any(), &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch)).await?;
    if st.phase != old.phase {
        let phase = st.phase.map_or("", JobPhase::as_str);
        tracing::info!(job = %job.name_any(), namespace = %names::namespace(job), phase, "phase changed");
    }
    Ok(())
}

async fn publish(ctx: &Context, job: &TrainingJob, note: &Note) {
    let event = Event {
        type_: if note.warning { EventType::Warning } else { EventType::Normal },
        reason: note.reason.clone(),
        note: Some(note.message.clone()),
        action: "Reconcile".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &job.object_ref(&())).await {
        tracing::debug!(job = %job.name_any(), "event not recorded: {e}");
    }
}
