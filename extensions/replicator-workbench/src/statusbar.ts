/**
 * The status bar item: backend · replicas · steps/s of the running run (else the session's
 * replicator). Clicking it opens the sidebar.
 */

import { Widget } from '@lumino/widgets';

export class ReplicatorStatus extends Widget {
  constructor(onClick: () => void) {
    super();
    this.addClass('wb-status');
    this.addClass('jp-StatusBar-TextItem');
    this.node.title = 'Replicator Workbench: click to open the sidebar';
    this.node.addEventListener('click', onClick);
  }

  /** Shows `text`; '' hides the item. */
  setText(text: string, running: boolean): void {
    this.node.textContent = text ? `Replicator: ${text}` : '';
    this.node.dataset.running = running ? 'true' : 'false';
    this.setHidden(!text);
  }
}
