//! Artifacts per (backend, target): a worker's hello asks for one, the shepherd
//! compiles it beside its loop (a bounded number at once) and answers with the manifest.

use super::*;

impl Host {
    pub(super) async fn on_hello(&mut self, id: InboundId, key: PublicKey, hello: NodeHello) -> anyhow::Result<()> {
        if hello.peer != key.0 {
            return self.refuse(id, 0, "the hello names another peer than its signer".into()).await;
        }
        let Some(backend) = hello.capabilities.backends.first() else {
            return self.refuse(id, 0, "the hello lists no backend".into()).await;
        };
        let name = backend.name.clone();
        let target = backend.targets.first().cloned().unwrap_or_default();
        self.node.admission().know(self.run, key);
        if self.backends.len() < MAX_BACKEND_RECORDS || self.backends.contains_key(&key) {
            let shown = if target.is_empty() { name.clone() } else { format!("{name}:{target}") };
            self.backends.insert(key, shown);
        }
        if let Some(artifact) = self.artifacts.get(&(name.clone(), target.clone())).cloned() {
            let envelope = self.manifest_for(artifact);
            return self.respond(id, envelope).await;
        }
        let parsed: Result<pcp_graph::Backend, _> = name.parse();
        let backend = match parsed {
            Ok(b) => b,
            Err(e) => return self.refuse(id, 0, e.to_string()).await,
        };
        // a target name the compiler does not know is refused with the accepted names
        let compile_target = match pcp_graph::Target::parse(backend, Some(&target)) {
            Ok(t) => t,
            Err(e) => return self.refuse(id, 0, format!("the shepherd cannot compile for {name}: {e}")).await,
        };
        let entry = (name.clone(), target.clone());
        if let Some(c) = self.compiling.get_mut(&entry) {
            c.waiters.push((id, key));
            return Ok(());
        }
        if self.compiling.len() >= MAX_COMPILES {
            return self.refuse(id, 0, "the shepherd is busy compiling for other targets; try again".into()).await;
        }
        if self.artifacts.len() + self.compiling.len() >= MAX_ARTIFACTS {
            return self.refuse(id, 0, format!("this run serves at most {MAX_ARTIFACTS} targets")).await;
        }
        self.compiling.insert(entry, Compiling { waiters: vec![(id, key)] });
        let module = self.step_module.clone();
        let dir = self.artifacts_dir.clone();
        let store = self.store.clone();
        tracing::info!("compiling train_step for {compile_target}");
        self.events
            .emit(ev::Event::CompileStarted(ev::CompileStarted { backend: name.clone(), target: target.clone() }));
        self.compiles.spawn_blocking(move || {
            let result =
                pcp_graph::compile(&module, &compile_target, Some(&dir)).map_err(|e| e.to_string()).and_then(|a| {
                    let hash = store.put_bytes(&a.vmfb).map_err(|e| e.to_string())?;
                    Ok((hash, a.vmfb.len() as u64, a.vmfb))
                });
            (name, target, result)
        });
        Ok(())
    }

    pub(super) async fn on_compiled(&mut self, (name, target, result): CompileResult) -> anyhow::Result<()> {
        let waiters = self.compiling.remove(&(name.clone(), target.clone())).map(|c| c.waiters).unwrap_or_default();
        match result {
            Ok((hash, size, _)) => {
                let artifact = ArtifactRef { backend: name.clone(), target: target.clone(), blob: hash.0, size };
                self.artifacts.insert((name.clone(), target.clone()), artifact.clone());
                self.plan.retention.pin(hash);
                self.manifest.artifacts = self.artifacts.values().cloned().collect();
                self.events.emit(ev::Event::ArtifactPublished(ev::ArtifactPublished {
                    backend: name.clone(),
                    target: target.clone(),
                    hash: hash.to_hex(),
                    bytes: size,
                }));
                if let Err(e) = self.node.provide(hash).await {
                    tracing::warn!("providing artifact {hash}: {e}");
                }
                for (id, _) in waiters {
                    let envelope = self.manifest_for(artifact.clone());
                    self.respond(id, envelope).await?;
                }
            }
            Err(reason) => {
                let shown = if target.is_empty() { name.clone() } else { format!("{name}:{target}") };
                let reason = format!("the shepherd cannot compile for {shown}: {reason}");
                self.events.emit(ev::Event::CompileFailed(ev::CompileFailed {
                    backend: name.clone(),
                    target: target.clone(),
                    reason: reason.clone(),
                }));
                for (id, _) in waiters {
                    self.refuse(id, 0, reason.clone()).await?;
                }
            }
        }
        Ok(())
    }

    /// The signed manifest with `artifact` first (the one the asker needs).
    pub(super) fn manifest_for(&mut self, artifact: ArtifactRef) -> SignedEnvelope {
        let mut manifest = self.manifest.clone();
        manifest.artifacts.retain(|a| a != &artifact);
        manifest.artifacts.insert(0, artifact);
        self.signer.seal(self.run, self.machine.completed(), &manifest)
    }
}
